/* tests/lib/fake_driver.c: see fake_driver.h. */
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>

#include "tests/lib/fake_driver.h"

void rw_test_use_fake_cuda(const char *argv0)
{
	char self[4096], fake[4200];
	snprintf(self, sizeof(self), "%s", argv0);
	snprintf(fake, sizeof(fake), "%s/../tests/cuda/libfakecuda.so", dirname(self));
	setenv("RW_CUDA_DRIVER", fake, 0);
}
