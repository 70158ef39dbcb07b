/* ipc/server_close.c: the descriptors a client passes are closed off the loop. A close() may
 * wait: the last close of a TCP socket with SO_LINGER set waits (up to its linger time, an hour
 * if the sender says so) for data its peer never reads; a FUSE file's waits for its server's
 * answer. A client that passes such an fd and closes its own copy would hold the daemon's loop
 * there (every rank, every peer's heartbeat). So a socket's linger is turned off first (it then
 * closes at once, in the background) and every passed fd goes to one closer thread, which is
 * the only one that can be held. The thread owns its queue once the server stops: it closes
 * what is left, frees the queue and ends, without the server waiting for it. Part of
 * ipc/server.c's server (ipc/server_int.h). */
#include "ipc/server_int.h"

#include <pthread.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

struct ipc_closer {
	pthread_mutex_t mu;
	pthread_cond_t cv;
	int *fds;        /* waiting to be closed */
	size_t n, cap;
	int stop;        /* the server is gone: close what is left, then free this and end */
};

static void closer_free(ipc_closer_t *k)
{
	pthread_cond_destroy(&k->cv);
	pthread_mutex_destroy(&k->mu);
	free(k->fds);
	free(k);
}

static void *closer_main(void *arg)
{
	ipc_closer_t *k = arg;
	pthread_mutex_lock(&k->mu);
	for (;;) {
		while (k->n == 0 && !k->stop)
			pthread_cond_wait(&k->cv, &k->mu);
		if (k->n == 0)
			break;
		const int fd = k->fds[--k->n];
		pthread_mutex_unlock(&k->mu);
		close(fd);
		pthread_mutex_lock(&k->mu);
	}
	pthread_mutex_unlock(&k->mu);
	closer_free(k);
	return NULL;
}

rw_status_t ipc_closer_start(rw_ipc_server_t *srv)
{
	ipc_closer_t *k = calloc(1, sizeof(*k));
	if (!k)
		return RW_ERR_NOMEM;
	pthread_mutex_init(&k->mu, NULL);
	pthread_cond_init(&k->cv, NULL);
	pthread_t t;
	pthread_attr_t attr;
	pthread_attr_init(&attr);
	pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
	const int rc = pthread_create(&t, &attr, closer_main, k);
	pthread_attr_destroy(&attr);
	if (rc != 0) {
		rw_err("ipc: cannot start the thread that closes passed descriptors");
		closer_free(k);
		return RW_ERR_SYS;
	}
	srv->closer = k;
	return RW_OK;
}

void ipc_closer_stop(rw_ipc_server_t *srv)
{
	ipc_closer_t *k = srv->closer;
	if (!k)
		return;
	srv->closer = NULL;
	pthread_mutex_lock(&k->mu);
	k->stop = 1; /* from here the thread owns k */
	pthread_cond_signal(&k->cv);
	pthread_mutex_unlock(&k->mu);
}

void ipc_fd_discard(rw_ipc_server_t *srv, int fd)
{
	struct stat st;
	if (fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode)) {
		const struct linger off = { .l_onoff = 0, .l_linger = 0 };
		(void)setsockopt(fd, SOL_SOCKET, SO_LINGER, &off, sizeof(off));
	}
	ipc_closer_t *k = srv->closer;
	pthread_mutex_lock(&k->mu);
	if (k->n == k->cap) {
		const size_t cap = k->cap ? 2 * k->cap : 16;
		int *fds = realloc(k->fds, cap * sizeof(*fds));
		if (!fds) { /* no room to queue it: closed here (its linger is off) */
			pthread_mutex_unlock(&k->mu);
			close(fd);
			return;
		}
		k->fds = fds;
		k->cap = cap;
	}
	k->fds[k->n++] = fd;
	pthread_cond_signal(&k->cv);
	pthread_mutex_unlock(&k->mu);
}
