/* tests/cuda/vmm_contract.c: GPU memory lent by fd, the same cases on the stand-in and on a GPU
 * (tests/cuda/vmm_contract.h). The import is made in this process from the owner's export: the
 * driver treats it as any importer's (a handle and a mapping of their own), and a second process
 * is what test/svc_slabs runs (a daemon lends, ranks import). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#ifdef RW_MINI_CMOCKA
#include "tests/cuda/mini_cmocka.h"
#else
#include <cmocka.h>
#endif

#include "cuda/rw_cuda.h"
#include "tests/cuda/vmm_contract.h"

void rw_vmm_case_export_import_same_memory(void)
{
	char why[160] = "";
	size_t gran = 0;
	assert_int_equal(rw_cuda_vmm_supported(0), 1);
	assert_int_equal(rw_cuda_vmm_granularity(0, &gran), RW_OK);
	assert_true(gran >= 4096 && (gran & (gran - 1)) == 0);
	rw_cuda_vmm_t *own = NULL, *imp = NULL;
	assert_int_equal(rw_cuda_vmm_create(0, gran + 1, &own, why, sizeof(why)), RW_OK);
	assert_int_equal(rw_cuda_vmm_bytes(own), 2 * gran); /* rounded up to the granularity */
	assert_int_equal(rw_cuda_vmm_device(own), 0);
	assert_true(rw_cuda_vmm_fd(own) >= 0);
	assert_true(rw_cuda_vmm_dptr(own) != 0);
	const size_t n = 2 * gran;
	static uint8_t a[4 << 20], b[4 << 20];
	assert_true(n <= sizeof(a));
	for (size_t i = 0; i < n; i++)
		a[i] = (uint8_t)(i * 7 + 3);
	assert_int_equal(rw_cuda_memcpy_htod(0, rw_cuda_vmm_dptr(own), a, n), RW_OK);

	int fd = dup(rw_cuda_vmm_fd(own)); /* what SCM_RIGHTS gives the importer: another fd */
	assert_true(fd >= 0);
	const int dev = 0;
	assert_int_equal(rw_cuda_vmm_import(fd, n, 0, &dev, 1, &imp, why, sizeof(why)), RW_OK);
	close(fd); /* the mapping does not need it */
	assert_int_equal(rw_cuda_vmm_fd(imp), -1);
	assert_int_equal(rw_cuda_vmm_bytes(imp), n);
	assert_true(rw_cuda_vmm_dptr(imp) != rw_cuda_vmm_dptr(own)); /* its own mapping */
	memset(b, 0, n);
	assert_int_equal(rw_cuda_memcpy_dtoh(0, b, rw_cuda_vmm_dptr(imp), n), RW_OK);
	assert_memory_equal(a, b, n); /* one memory, seen through both mappings */
	assert_int_equal(rw_cuda_memset_d8(0, rw_cuda_vmm_dptr(imp) + gran, 0x5a, 64), RW_OK);
	assert_int_equal(rw_cuda_memcpy_dtoh(0, b, rw_cuda_vmm_dptr(own) + gran, 64), RW_OK);
	for (int i = 0; i < 64; i++)
		assert_int_equal(b[i], 0x5a);

	/* The owner lets go first: the importer's mapping keeps the memory. */
	rw_cuda_vmm_release(own);
	assert_int_equal(rw_cuda_memcpy_dtoh(0, b, rw_cuda_vmm_dptr(imp), 64), RW_OK);
	assert_memory_equal(a, b, 64);
	rw_cuda_vmm_release(imp);
}

void rw_vmm_case_refusals(void)
{
	char why[160] = "";
	size_t gran = 0;
	assert_int_equal(rw_cuda_vmm_granularity(0, &gran), RW_OK);
	rw_cuda_vmm_t *own = NULL, *imp = NULL;
	assert_int_equal(rw_cuda_vmm_create(0, 0, &own, why, sizeof(why)), RW_ERR_INVAL);
	assert_int_equal(rw_cuda_vmm_create(0, gran, &own, why, sizeof(why)), RW_OK);
	const int dev = 0, ndev = rw_cuda_device_count();
	/* An fd that is no export: a memfd of the right size, and a pipe. */
	int mfd = memfd_create("not-an-export", MFD_CLOEXEC), p[2];
	assert_true(mfd >= 0 && ftruncate(mfd, (off_t)gran) == 0 && pipe(p) == 0);
	why[0] = 0;
	assert_int_not_equal(rw_cuda_vmm_import(mfd, gran, 0, &dev, 1, &imp, why, sizeof(why)),
			     RW_OK);
	assert_non_null(strstr(why, "cuMemImportFromShareableHandle"));
	assert_int_not_equal(rw_cuda_vmm_import(p[0], gran, 0, &dev, 1, &imp, why, sizeof(why)),
			     RW_OK);
	assert_int_equal(rw_cuda_vmm_import(-1, gran, 0, &dev, 1, &imp, why, sizeof(why)),
			 RW_ERR_INVAL);
	/* A size off the granularity, a device that is not here, no device to grant. */
	const int fd = rw_cuda_vmm_fd(own);
	assert_int_equal(rw_cuda_vmm_import(fd, gran / 2, 0, &dev, 1, &imp, why, sizeof(why)),
			 RW_ERR_INVAL);
	assert_int_equal(rw_cuda_vmm_import(fd, gran, ndev, &dev, 1, &imp, why, sizeof(why)),
			 RW_ERR_INVAL);
	assert_non_null(strstr(why, "does not exist"));
	const int bad = ndev;
	assert_int_equal(rw_cuda_vmm_import(fd, gran, 0, &bad, 1, &imp, why, sizeof(why)),
			 RW_ERR_INVAL);
	assert_int_equal(rw_cuda_vmm_import(fd, gran, 0, &dev, 0, &imp, why, sizeof(why)),
			 RW_ERR_INVAL);
	assert_true(imp == NULL);
	/* The export still imports after all that. */
	assert_int_equal(rw_cuda_vmm_import(fd, gran, 0, &dev, 1, &imp, why, sizeof(why)), RW_OK);
	rw_cuda_vmm_release(imp);
	rw_cuda_vmm_release(own);
	close(mfd);
	close(p[0]);
	close(p[1]);
}

/* Poll the pull's word as the daemon's loop does, for at most 10 s. */
static int landed_by(rw_cuda_pull_t *p, uint64_t mark)
{
	for (int i = 0; i < 100000; i++) {
		if (rw_cuda_pull_landed(p) >= mark)
			return 1;
		assert_int_equal(rw_cuda_pull_fault(p), RW_OK);
		usleep(100);
	}
	return 0;
}

void rw_vmm_case_pull_rows(void)
{
	char why[160] = "";
	rw_cuda_vmm_t *v = NULL;
	assert_int_equal(rw_cuda_vmm_create(0, 1, &v, why, sizeof(why)), RW_OK);
	enum { PITCH = 96, WIDTH = 24, ROWS = 100, OFF = 4096 };
	static uint8_t a[OFF + PITCH * ROWS];
	for (size_t i = 0; i < sizeof(a); i++)
		a[i] = (uint8_t)(i * 13 + 1);
	assert_int_equal(rw_cuda_memcpy_htod(0, rw_cuda_vmm_dptr(v), a, sizeof(a)), RW_OK);
	uint8_t *h = NULL;
	assert_int_equal(rw_cuda_host_alloc(PITCH * ROWS, (void **)&h), RW_OK);
	memset(h, 0xee, PITCH * ROWS);
	rw_cuda_pull_t *p = NULL;
	assert_int_equal(rw_cuda_pull_create(0, &p), RW_OK);
	assert_int_equal(rw_cuda_pull_device(p), 0);
	assert_int_equal(rw_cuda_pull_landed(p), 0);
	uint64_t m1 = 0, m2 = 0;
	assert_int_equal(rw_cuda_pull_rows(p, h, PITCH, rw_cuda_vmm_dptr(v) + OFF, PITCH, WIDTH,
					   ROWS / 2), RW_OK);
	assert_int_equal(rw_cuda_pull_mark(p, &m1), RW_OK);
	assert_int_equal(rw_cuda_pull_rows(p, h + PITCH * (ROWS / 2), PITCH,
					   rw_cuda_vmm_dptr(v) + OFF + PITCH * (ROWS / 2), PITCH,
					   WIDTH, ROWS / 2), RW_OK);
	assert_int_equal(rw_cuda_pull_mark(p, &m2), RW_OK);
	assert_int_equal(m1, 1);
	assert_int_equal(m2, 2);
	assert_true(landed_by(p, m2));
	for (size_t r = 0; r < ROWS; r++)
		for (size_t i = 0; i < PITCH; i++)
			assert_int_equal(h[r * PITCH + i], i < WIDTH ? a[OFF + r * PITCH + i] : 0xee);
	/* nothing to copy, and arguments that cannot be */
	assert_int_equal(rw_cuda_pull_rows(p, h, PITCH, rw_cuda_vmm_dptr(v), PITCH, WIDTH, 0), RW_OK);
	assert_int_equal(rw_cuda_pull_rows(p, h, 8, rw_cuda_vmm_dptr(v), PITCH, WIDTH, 1),
			 RW_ERR_INVAL);
	assert_int_equal(rw_cuda_pull_rows(p, h, PITCH, 0, PITCH, WIDTH, 1), RW_ERR_INVAL);
	rw_cuda_pull_destroy(p);
	rw_cuda_host_free(h);
	rw_cuda_vmm_release(v);
}
