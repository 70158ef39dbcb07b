/* cuda/graph.c: CUDA graphs of a caller's stream (cuda/rw_cuda.h "graphs"): capture what is
 * enqueued on it, then replay the recorded work with one call. The rank path's static mode is
 * what makes a phase replayable (docs/rankpath.md "Static mode and CUDA graphs"); tests and tools
 * capture through these. Every entry point is optional in the driver table. */
#include "cuda/cuda_int.h"

#if RW_HAVE_CUDA_H
#include <stdlib.h>

struct rw_cuda_graph {
	int device;
	CUgraph graph;
	CUgraphExec exec;
};

rw_status_t rw_cuda_graph_begin(const rw_cuda_ext_stream_t *s)
{
	rw_status_t st = rw_cu_enter(s->device);
	if (st != RW_OK)
		return st;
	if (!rw_cu.cuStreamBeginCapture || !rw_cu.cuStreamEndCapture)
		return RW_ERR_UNSUPPORTED;
	/* Global mode: a call of this process that is unsafe during a capture (a host
	 * synchronization) fails and invalidates the capture, as torch's default does. */
	CUresult res = rw_cu.cuStreamBeginCapture((CUstream)(uintptr_t)s->handle,
						  CU_STREAM_CAPTURE_MODE_GLOBAL);
	return res == CUDA_SUCCESS ? RW_OK : rw_cu_fail(res, "cuStreamBeginCapture");
}

rw_status_t rw_cuda_graph_end(const rw_cuda_ext_stream_t *s, rw_cuda_graph_t **graph_p)
{
	rw_status_t st = rw_cu_enter(s->device);
	if (st != RW_OK)
		return st;
	if (!rw_cu.cuStreamEndCapture || !rw_cu.cuGraphInstantiate || !rw_cu.cuGraphDestroy)
		return RW_ERR_UNSUPPORTED;
	CUgraph g = NULL;
	CUresult res = rw_cu.cuStreamEndCapture((CUstream)(uintptr_t)s->handle, &g);
	if (res != CUDA_SUCCESS)
		return rw_cu_fail(res, "cuStreamEndCapture");
	rw_cuda_graph_t *gr = calloc(1, sizeof(*gr));
	if (!gr) {
		rw_cu.cuGraphDestroy(g);
		return RW_ERR_NOMEM;
	}
	res = rw_cu.cuGraphInstantiate(&gr->exec, g, 0);
	if (res != CUDA_SUCCESS) {
		rw_cu.cuGraphDestroy(g);
		free(gr);
		return rw_cu_fail(res, "cuGraphInstantiate");
	}
	gr->device = s->device;
	gr->graph = g;
	*graph_p = gr;
	return RW_OK;
}

rw_status_t rw_cuda_graph_launch(rw_cuda_graph_t *g, const rw_cuda_ext_stream_t *s)
{
	if (!g || s->device != g->device)
		return RW_ERR_INVAL;
	rw_status_t st = rw_cu_enter(s->device);
	if (st != RW_OK)
		return st;
	if (!rw_cu.cuGraphLaunch)
		return RW_ERR_UNSUPPORTED;
	CUresult res = rw_cu.cuGraphLaunch(g->exec, (CUstream)(uintptr_t)s->handle);
	return res == CUDA_SUCCESS ? RW_OK : rw_cu_fail(res, "cuGraphLaunch");
}

void rw_cuda_graph_destroy(rw_cuda_graph_t *g)
{
	if (!g || rw_cu_enter(g->device) != RW_OK)
		return;
	if (rw_cu.cuGraphExecDestroy)
		rw_cu.cuGraphExecDestroy(g->exec);
	rw_cu.cuGraphDestroy(g->graph);
	free(g);
}
#endif /* RW_HAVE_CUDA_H */
