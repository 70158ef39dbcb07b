/* Peer authentication's cryptography (docs/security.md "Peer authentication"): the cluster key
 * file, the challenge nonces, the proofs exchanged in AUTH, the per-session key and the rail
 * connection proofs derived from it. Everything is libsodium's crypto_auth (HMAC-SHA512-256)
 * keyed with the cluster key or the session key, over a labelled, fixed-layout message; proofs
 * are checked with crypto_auth_verify (constant time). A leaf: returns statuses, logs nothing. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <sodium.h>

#include "service/mesh/mesh_int.h"

_Static_assert(MESH_KEY_SIZE == crypto_auth_KEYBYTES, "the cluster key is a crypto_auth key");
_Static_assert(RW_WIRE_PROOF_SIZE == crypto_auth_BYTES, "a proof is one crypto_auth tag");
_Static_assert(RW_RAIL_PROOF_SIZE == crypto_auth_BYTES, "a rail proof is one crypto_auth tag");

rw_status_t mesh_auth_init(void)
{
	return sodium_init() < 0 ? RW_ERR_SYS : RW_OK;
}

rw_status_t mesh_auth_key_load(const char *path, uint8_t key_p[MESH_KEY_SIZE], char *why,
			       size_t why_len)
{
	rw_status_t st = RW_ERR_PARSE;
	int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
	if (fd < 0) {
		snprintf(why, why_len, "cannot open key file %s: %s", path, strerror(errno));
		return errno == ENOENT ? RW_ERR_NOTFOUND : errno == EACCES ? RW_ERR_INVAL : RW_ERR_SYS;
	}
	struct stat sb;
	char text[2 * MESH_KEY_SIZE + 8];
	ssize_t n;
	if (fstat(fd, &sb) < 0 || !S_ISREG(sb.st_mode)) {
		snprintf(why, why_len, "key file %s is not a regular file", path);
		goto close_fd;
	}
	if (sb.st_mode & (S_IRWXG | S_IRWXO)) {
		snprintf(why, why_len, "key file %s is readable or writable by others (mode %04o): "
			 "refusing it; chmod 600 %s", path, (unsigned)(sb.st_mode & 07777), path);
		st = RW_ERR_INVAL;
		goto close_fd;
	}
	n = read(fd, text, sizeof(text) - 1);
	if (n < 0) {
		snprintf(why, why_len, "cannot read key file %s: %s", path, strerror(errno));
		st = RW_ERR_SYS;
		goto close_fd;
	}
	while (n > 0 && (text[n - 1] == '\n' || text[n - 1] == '\r'))
		n--;
	text[n] = '\0';
	uint8_t key[MESH_KEY_SIZE];
	size_t bin_len = 0;
	if (n != 2 * MESH_KEY_SIZE ||
	    sodium_hex2bin(key, sizeof(key), text, (size_t)n, NULL, &bin_len, NULL) != 0 ||
	    bin_len != MESH_KEY_SIZE) {
		snprintf(why, why_len, "key file %s does not hold one key (%d hex digits and a "
			 "newline, as 'railwave keygen' writes)", path, 2 * MESH_KEY_SIZE);
		sodium_memzero(text, sizeof(text));
		goto close_fd;
	}
	memcpy(key_p, key, MESH_KEY_SIZE);
	sodium_memzero(key, sizeof(key));
	sodium_memzero(text, sizeof(text));
	st = RW_OK;
close_fd:
	close(fd);
	return st;
}

void mesh_auth_nonce(uint8_t nonce[RW_WIRE_NONCE_SIZE])
{
	randombytes_buf(nonce, RW_WIRE_NONCE_SIZE);
}

/* The message a proof or the session key is a MAC of: label | role | both node ids | the
 * fingerprint | both nonces. Fixed layout, so two different inputs never give one message. */
#define AUTH_LABEL_SIZE 16
#define AUTH_MSG_SIZE (AUTH_LABEL_SIZE + 4 + 4 + 4 + 8 + 2 * RW_WIRE_NONCE_SIZE)

static void auth_msg(const char *label, uint32_t role, const mesh_auth_ids_t *ids,
		     uint8_t msg[AUTH_MSG_SIZE])
{
	memset(msg, 0, AUTH_LABEL_SIZE);
	memcpy(msg, label, strnlen(label, AUTH_LABEL_SIZE));
	uint8_t *p = msg + AUTH_LABEL_SIZE;
	rw_wire_put32(p, role);
	rw_wire_put32(p + 4, ids->connector);
	rw_wire_put32(p + 8, ids->acceptor);
	rw_wire_put64(p + 12, ids->fingerprint);
	memcpy(p + 20, ids->nonce_c, RW_WIRE_NONCE_SIZE);
	memcpy(p + 20 + RW_WIRE_NONCE_SIZE, ids->nonce_a, RW_WIRE_NONCE_SIZE);
}

void mesh_auth_proof(const uint8_t key[MESH_KEY_SIZE], const mesh_auth_ids_t *ids,
		     mesh_auth_role_t role, uint8_t proof[RW_WIRE_PROOF_SIZE])
{
	uint8_t msg[AUTH_MSG_SIZE];
	auth_msg("railwave-auth-5", role, ids, msg);
	crypto_auth(proof, msg, sizeof(msg), key);
}

int mesh_auth_proof_ok(const uint8_t key[MESH_KEY_SIZE], const mesh_auth_ids_t *ids,
		       mesh_auth_role_t role, const uint8_t proof[RW_WIRE_PROOF_SIZE])
{
	uint8_t msg[AUTH_MSG_SIZE];
	auth_msg("railwave-auth-5", role, ids, msg);
	return crypto_auth_verify(proof, msg, sizeof(msg), key) == 0;
}

void mesh_auth_session(const uint8_t key[MESH_KEY_SIZE], const mesh_auth_ids_t *ids,
		       uint8_t session[MESH_KEY_SIZE])
{
	uint8_t msg[AUTH_MSG_SIZE];
	auth_msg("railwave-sess-5", 0, ids, msg);
	crypto_auth(session, msg, sizeof(msg), key);
}

/* A rail connection's proof: a MAC with the session key over role | rail | dial, truncated to
 * RAIL_MAC_SIZE bytes, then the dial number (u64 little-endian). The session key is fresh per
 * control session; within one, the connector numbers its dials of a rail from 1 (a rail that
 * fails alone is redialed while the session lives) and the acceptor takes only a number above
 * the last one it took, so a captured handshake replayed later names a dead session or a dial
 * already used. The acceptor's reply repeats the dial it answers. */
#define RAIL_MAC_SIZE (RW_RAIL_PROOF_SIZE - 8)

static void rail_mac(const uint8_t session[MESH_KEY_SIZE], mesh_auth_role_t role, uint32_t rail,
		     uint64_t dial, uint8_t mac[crypto_auth_BYTES])
{
	uint8_t msg[AUTH_LABEL_SIZE + 16];
	memset(msg, 0, AUTH_LABEL_SIZE);
	memcpy(msg, "railwave-rail-5", 15);
	rw_wire_put32(msg + AUTH_LABEL_SIZE, role);
	rw_wire_put32(msg + AUTH_LABEL_SIZE + 4, rail);
	rw_wire_put64(msg + AUTH_LABEL_SIZE + 8, dial);
	crypto_auth(mac, msg, sizeof(msg), session);
}

void mesh_auth_rail_proof(const uint8_t session[MESH_KEY_SIZE], mesh_auth_role_t role,
			  uint32_t rail, uint64_t dial, uint8_t proof[RW_RAIL_PROOF_SIZE])
{
	uint8_t mac[crypto_auth_BYTES];
	rail_mac(session, role, rail, dial, mac);
	memcpy(proof, mac, RAIL_MAC_SIZE);
	rw_wire_put64(proof + RAIL_MAC_SIZE, dial);
}

int mesh_auth_rail_proof_ok(const uint8_t session[MESH_KEY_SIZE], mesh_auth_role_t role,
			    uint32_t rail, const uint8_t proof[RW_RAIL_PROOF_SIZE], uint64_t *dial_p)
{
	uint8_t mac[crypto_auth_BYTES];
	uint64_t dial = rw_wire_get64(proof + RAIL_MAC_SIZE);
	rail_mac(session, role, rail, dial, mac);
	if (sodium_memcmp(mac, proof, RAIL_MAC_SIZE) != 0)
		return 0;
	*dial_p = dial;
	return 1;
}

void mesh_auth_wipe(void *p, size_t len)
{
	sodium_memzero(p, len);
}
