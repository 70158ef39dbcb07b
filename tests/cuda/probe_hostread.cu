// tests/cuda/probe_hostread.cu: do a kernel's reads of ONE host-memory address by many warps
// queue behind each other? (docs/perf/rankpath.md "Reads of one host address queue": they do, ~1 us each on
// an H100, which is why the rank kernels read the page's words from a device mirror.) Each kernel
// runs G blocks x 256 threads and reads pinned, mapped host memory (or device memory: "dev") in
// one pattern; best of 7 launches, CUDA events. A standalone probe (runtime API), built by hand:
//   nvcc -arch=sm_90 -O2 -o hostread tests/cuda/probe_hostread.cu && ./hostread
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

__global__ void same_all(const volatile uint32_t *p, uint32_t *out) { // every thread, one address
	uint32_t v = p[0];
	if (v == 0xdeadbeef) out[0] = v;
}
__global__ void same_warp(const volatile uint32_t *p, uint32_t *out) { // lane 0 of each warp
	if (threadIdx.x % 32 == 0) { uint32_t v = p[0]; if (v == 0xdeadbeef) out[0] = v; }
}
__global__ void same_block(const volatile uint32_t *p, uint32_t *out) { // thread 0 of each block
	if (threadIdx.x == 0) { uint32_t v = p[0]; if (v == 0xdeadbeef) out[0] = v; }
}
__global__ void same_nonvol(const uint32_t *p, uint32_t *out) { // every thread, plain load
	uint32_t v = p[0];
	if (v == 0xdeadbeef) out[0] = v;
}
__global__ void distinct_warp(const volatile uint32_t *p, uint32_t *out) { // lane 0, own 128 B line
	if (threadIdx.x % 32 == 0) {
		uint32_t w = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
		uint32_t v = p[(w % 8192) * 32]; if (v == 0xdeadbeef) out[0] = v;
	}
}
__global__ void lines8_warp(const volatile uint32_t *p, uint32_t *out) { // lane 0, 8 blocks share a line
	if (threadIdx.x % 32 == 0) {
		uint32_t v = p[(blockIdx.x / 8) * 32 % (8192 * 32)]; if (v == 0xdeadbeef) out[0] = v;
	}
}

typedef void (*kfn)(const volatile uint32_t *, uint32_t *);
int main()
{
	uint32_t *h, *hd, *d, *out;
	CK(cudaHostAlloc(&h, 8192 * 128, cudaHostAllocMapped));
	for (int i = 0; i < 8192 * 32; i++) h[i] = i;
	CK(cudaHostGetDevicePointer(&hd, h, 0));
	CK(cudaMalloc(&d, 8192 * 128));
	CK(cudaMemset(d, 0, 8192 * 128));
	CK(cudaMalloc(&out, 4));
	cudaEvent_t a, b;
	cudaEventCreate(&a); cudaEventCreate(&b);
	struct { const char *name; kfn f; } ks[] = {
		{ "same address, every thread (volatile)", same_all },
		{ "same address, lane 0 of every warp", same_warp },
		{ "same address, thread 0 of every block", same_block },
		{ "same address, every thread (plain ld)", (kfn)same_nonvol },
		{ "own 128 B line per warp (lane 0)", distinct_warp },
		{ "8 blocks share a line (lane 0)", lines8_warp },
	};
	const int grids[] = { 1, 8, 132, 674, 2048 };
	for (int mem = 0; mem < 2; mem++)
		for (auto &k : ks) {
			printf("%-4s %-40s", mem ? "dev" : "host", k.name);
			for (int g : grids) {
				const uint32_t *p = mem ? d : hd;
				k.f<<<g, 256>>>(p, out);
				CK(cudaDeviceSynchronize());
				float best = 1e30f;
				for (int r = 0; r < 7; r++) {
					cudaEventRecord(a);
					k.f<<<g, 256>>>(p, out);
					cudaEventRecord(b);
					CK(cudaEventSynchronize(b));
					float ms; cudaEventElapsedTime(&ms, a, b);
					if (ms < best) best = ms;
				}
				printf(" | G=%-4d %8.1f us", g, best * 1000);
			}
			printf("\n");
		}
	return 0;
}
