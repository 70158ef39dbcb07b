/* Sending a datagram with descriptors attached (SCM_RIGHTS) on a unix socket: the rank client's
 * requests, the IPC server's replies, the shm transport's control messages, and the IPC tests'
 * raw clients. Header-only, so
 * the rank library (libc and pthreads only) uses it without linking libcommon. */
#ifndef RW_COMMON_FDPASS_H
#define RW_COMMON_FDPASS_H

#include <errno.h>
#include <string.h>
#include <sys/socket.h>

#define RW_FDPASS_MAX 8 /* descriptors one message may carry */

/* sendmsg() of buf[0..len) with nfds descriptors (none when nfds is 0), retried on EINTR; flags
 * as sendmsg's (MSG_DONTWAIT, MSG_NOSIGNAL). Returns sendmsg's result: the bytes sent, or -1
 * with errno (EINVAL for more than RW_FDPASS_MAX descriptors). */
static inline ssize_t rw_fdpass_send(int sock, const void *buf, size_t len, const int *fds,
				     unsigned nfds, int flags)
{
	union {
		char buf[CMSG_SPACE(sizeof(int) * RW_FDPASS_MAX)];
		struct cmsghdr align;
	} ctl;
	struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
	struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
	if (nfds > RW_FDPASS_MAX) {
		errno = EINVAL;
		return -1;
	}
	if (nfds) {
		memset(&ctl, 0, sizeof(ctl));
		mh.msg_control = ctl.buf;
		mh.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
		struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
		cm->cmsg_level = SOL_SOCKET;
		cm->cmsg_type = SCM_RIGHTS;
		cm->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
		memcpy(CMSG_DATA(cm), fds, sizeof(int) * nfds);
	}
	ssize_t n;
	do
		n = sendmsg(sock, &mh, flags);
	while (n < 0 && errno == EINTR);
	return n;
}

#endif
