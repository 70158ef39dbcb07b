/* tests/lib/fake_driver.h: point cuda/'s run-time loader at the in-process stand-in driver built
 * next to a test program (build/test/X -> build/tests/cuda/libfakecuda.so), unless
 * $RW_CUDA_DRIVER already names a driver. Call first thing in main. */
#ifndef RW_TESTS_FAKE_DRIVER_H
#define RW_TESTS_FAKE_DRIVER_H

void rw_test_use_fake_cuda(const char *argv0);

#endif /* RW_TESTS_FAKE_DRIVER_H */
