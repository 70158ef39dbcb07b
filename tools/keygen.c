/* `railwave keygen [--force] [PATH]`: a new cluster key for peer authentication (docs/security.md
 * "Peer authentication", docs/install.md "The cluster key"): 32 random bytes from libsodium,
 * written as 64 hex digits and a newline into PATH, created with mode 0600 (an existing file is
 * kept unless --force), or printed on stdout without PATH (for a Kubernetes Secret). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <sodium.h>

#include "tools/tools.h"

#define KEY_BYTES crypto_auth_KEYBYTES

static int usage(FILE *f)
{
	fprintf(f, "usage: railwave keygen [--force] [PATH]\n"
		   "  Write a new cluster key (%d hex digits) into PATH, mode 0600; without PATH\n"
		   "  print it. Every node of a cluster needs the same key (key_file in the config).\n"
		   "  --force  replace an existing PATH\n", 2 * KEY_BYTES);
	return f == stdout ? 0 : 2;
}

int rw_tool_keygen(int argc, char **argv)
{
	const char *path = NULL;
	int force = 0;
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h"))
			return usage(stdout);
		if (!strcmp(argv[i], "--force"))
			force = 1;
		else if (argv[i][0] == '-' || path)
			return usage(stderr);
		else
			path = argv[i];
	}
	if (sodium_init() < 0) {
		fprintf(stderr, "railwave keygen: cannot initialise libsodium\n");
		return 1;
	}
	uint8_t key[KEY_BYTES];
	char text[2 * KEY_BYTES + 2];
	randombytes_buf(key, sizeof(key));
	sodium_bin2hex(text, sizeof(text), key, sizeof(key));
	sodium_memzero(key, sizeof(key));
	size_t len = strlen(text);
	text[len++] = '\n';
	int rc = 1;
	if (!path) {
		rc = fwrite(text, 1, len, stdout) == len && fflush(stdout) == 0 ? 0 : 1;
		goto wipe;
	}
	int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW | (force ? O_TRUNC : O_EXCL),
		      0600);
	if (fd < 0) {
		fprintf(stderr, "railwave keygen: cannot create %s: %s%s\n", path, strerror(errno),
			errno == EEXIST ? " (--force replaces it)" : "");
		goto wipe;
	}
	/* An existing file replaced with --force keeps its inode: make its mode 0600 too. */
	if (fchmod(fd, 0600) < 0 || write(fd, text, len) != (ssize_t)len || fsync(fd) < 0) {
		fprintf(stderr, "railwave keygen: cannot write %s: %s\n", path, strerror(errno));
		close(fd);
		goto wipe;
	}
	if (close(fd) < 0) {
		fprintf(stderr, "railwave keygen: cannot write %s: %s\n", path, strerror(errno));
		goto wipe;
	}
	fprintf(stderr, "railwave keygen: wrote a new cluster key to %s (mode 0600)\n", path);
	rc = 0;
wipe:
	sodium_memzero(text, sizeof(text));
	return rc;
}
