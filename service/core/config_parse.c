/* The configuration loader's leaves (config_int.h): the primitive parsers of names, addresses,
 * ports and numbers, the names of enum values, and the error helper every loader file reports
 * through. Nothing here calls another config*.c file. */
#include "service/core/config_int.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *const cfg_log_level_names[RW_LOG_DEBUG + 1] = {"error", "warn", "info", "debug"};

const char *rw_svc_transport_name(rw_svc_transport_t t)
{
	return t == RW_SVC_TRANSPORT_VERBS ? "verbs" : t == RW_SVC_TRANSPORT_SHM ? "shm" : "tcp";
}

rw_status_t cfg_fail(loader_t *ld, const char *fmt, ...)
{
	if (ld->err && ld->err_len) {
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(ld->err, ld->err_len, fmt, ap);
		va_end(ap);
	}
	return RW_ERR_PARSE;
}

int cfg_is_name(const char *s)
{
	size_t n = strlen(s);
	if (n == 0 || n >= RW_SVC_NAME_MAX)
		return 0;
	for (size_t i = 0; i < n; i++)
		if (!isalnum((unsigned char)s[i]) && s[i] != '.' && s[i] != '_' && s[i] != '-')
			return 0;
	return 1;
}

const char *cfg_json_type_name(const json_t *v)
{
	switch (json_typeof(v)) {
	case JSON_OBJECT: return "an object";
	case JSON_ARRAY: return "an array";
	case JSON_STRING: return "a string";
	case JSON_INTEGER: return "an integer";
	case JSON_REAL: return "a number";
	case JSON_TRUE:
	case JSON_FALSE: return "a boolean";
	case JSON_NULL: return "null";
	}
	return "?";
}

/* "a.b.c.d" -> endpoint (port untouched). 0 if not a dotted-quad IPv4 address. */
int cfg_parse_ipv4(const char *s, rw_svc_endpoint_t *ep)
{
	struct in_addr a;
	if (strlen(s) >= sizeof(ep->text) || inet_pton(AF_INET, s, &a) != 1)
		return 0;
	memset(&ep->sin, 0, sizeof(ep->sin));
	ep->sin.sin_family = AF_INET;
	ep->sin.sin_addr = a;
	ep->sin.sin_port = htons(ep->port);
	snprintf(ep->text, sizeof(ep->text), "%s", s);
	return 1;
}

void cfg_set_port(rw_svc_endpoint_t *ep, uint16_t port)
{
	ep->port = port;
	ep->sin.sin_port = htons(port);
}

/* Parse a decimal integer in [min, max]; the whole string must be digits. */
int cfg_parse_uint(const char *s, unsigned long long min, unsigned long long max,
		      unsigned long long *v_p)
{
	if (!*s || strlen(s) > 20)
		return 0;
	for (const char *p = s; *p; p++)
		if (!isdigit((unsigned char)*p))
			return 0;
	errno = 0;
	unsigned long long v = strtoull(s, NULL, 10);
	if (errno || v < min || v > max)
		return 0;
	*v_p = v;
	return 1;
}

/* "ADDR" or "ADDR:PORT" (port 0..65535 when allow_zero, else 1..). has_port_p may be NULL. */
int cfg_parse_addr_port(const char *s, int allow_zero, rw_svc_endpoint_t *ep, int *has_port_p)
{
	char buf[64];
	if (strlen(s) >= sizeof(buf))
		return 0;
	snprintf(buf, sizeof(buf), "%s", s);
	char *colon = strchr(buf, ':');
	int has_port = 0;
	unsigned long long port = 0;
	if (colon) {
		*colon = '\0';
		if (!cfg_parse_uint(colon + 1, allow_zero ? 0 : 1, 65535, &port))
			return 0;
		has_port = 1;
	}
	if (!cfg_parse_ipv4(buf, ep))
		return 0;
	if (has_port)
		cfg_set_port(ep, (uint16_t)port);
	if (has_port_p)
		*has_port_p = has_port;
	return 1;
}

/* http value: off, or an address with a port. Returns 1 if valid. */
int cfg_parse_http(const char *s, int *enabled_p, rw_svc_endpoint_t *ep)
{
	if (!*s || !strcmp(s, "0") || !strcmp(s, "off")) {
		*enabled_p = 0;
		return 1;
	}
	int has_port = 0;
	rw_svc_endpoint_t tmp = {0};
	if (!cfg_parse_addr_port(s, 1, &tmp, &has_port) || !has_port)
		return 0;
	*ep = tmp;
	*enabled_p = 1;
	return 1;
}

int cfg_lookup_name(const char *const *names, size_t n, const char *s)
{
	for (size_t i = 0; i < n; i++)
		if (!strcmp(names[i], s))
			return (int)i;
	return -1;
}
