/* ipc/page_word.c: a rank page's words as wake-ups (ipc/page.h "Waking the other side"). A word
 * is still only memory: these add a futex wake after a CPU's store and a bounded futex wait to a
 * CPU's wait, keyed on the word's own low 32 bits, so a host rank and the daemon's poller sleep
 * until the other side's store instead of for a fixed period. A side that cannot wake (a CUDA
 * stream) changes nothing: a wait still ends at its bound. Both faces link it (page.c's rule). */
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "ipc/page.h"

uint32_t *rw_page_word_futex(const _Atomic uint64_t *word)
{
	/* The low half changes with every phase step (the words move by 1 to D): the futex's value.
	 * The pointer drops the const: the kernel only reads a futex's value. */
	uint32_t *half = (uint32_t *)(uintptr_t)word;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
	half++;
#endif
	return half;
}

void rw_page_word_publish(_Atomic uint64_t *word, uint64_t value)
{
	atomic_store_explicit(word, value, memory_order_release);
	/* Shared (not _PRIVATE): the waiter is in the other process. Every waiter: a page's word has
	 * one reader on each side at most, and a wake with none costs one lookup. */
	(void)syscall(SYS_futex, rw_page_word_futex(word), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

int rw_page_word_nap(const _Atomic uint64_t *word, uint64_t seen, long ns)
{
	if (ns <= 0)
		return RW_PAGE_NAP_TIMEOUT;
	const struct timespec t = { .tv_sec = ns / 1000000000, .tv_nsec = ns % 1000000000 };
	/* Refused at once (EAGAIN) if the low half is no longer seen's: the word moved. */
	if (syscall(SYS_futex, rw_page_word_futex(word), FUTEX_WAIT, (uint32_t)seen, &t, NULL, 0) == 0)
		return RW_PAGE_NAP_WOKEN;
	return errno == EAGAIN ? RW_PAGE_NAP_MOVED : RW_PAGE_NAP_TIMEOUT;
}
