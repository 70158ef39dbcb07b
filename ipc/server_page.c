/* The daemon side of the rank page (docs/rankpath.md "The rank page"; layout and word rules in
 * ipc/page.h): made at a joined rank's request, sized for the cluster's nodes and rails and the
 * rank's receive bound, sealed against shrinking, growing and new seals before the rank sees it
 * (as the rings are), kept mapped here until the rank leaves. Part of ipc/server.c's server
 * (ipc/server_int.h). */
#include "ipc/server_int.h"

#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "ipc/page.h"

void ipc_page_free(rw_ipc_client_t *c)
{
	if (!c->page)
		return;
	munmap(c->page, c->page_bytes);
	c->page = NULL;
	c->page_bytes = 0;
}

void *rw_ipc_client_page(const rw_ipc_client_t *c, size_t *bytes_p)
{
	if (bytes_p)
		*bytes_p = c->page_bytes;
	return c->page;
}

int ipc_page_setup(rw_ipc_client_t *c, const rw_ipc_page_setup_t *req)
{
	const uint32_t seq = req->hdr.seq;
	const rw_ipc_server_config_t *cfg = &c->srv->cfg;
	if (c->page)
		return ipc_send_error(c, seq, RW_E_STATE, "rank page already set up", 0);
	if (cfg->page_rails == 0 || cfg->world_size == 0 || cfg->gpus_per_node == 0)
		return ipc_send_error(c, seq, RW_E_STATE, "this daemon lends no rank page (no rails "
				      "or cluster geometry configured for it)", 0);
	const uint32_t bound = cfg->page_max_recv ? cfg->page_max_recv : c->srv->lim.max_tokens;
	if (req->max_recv == 0 || req->max_recv > bound)
		return ipc_send_error(c, seq, RW_E_TOKENS, "page setup: max_recv 0 or above the "
				      "daemon's bound on records a rank receives in one phase", 0);
	const uint32_t nodes = cfg->world_size / cfg->gpus_per_node;
	rw_page_layout_t l;
	if (rw_page_layout(nodes, cfg->page_rails, req->max_recv, (size_t)sysconf(_SC_PAGESIZE), &l))
		return ipc_send_error(c, seq, RW_E_TOKENS, "page setup: a page for this max_recv "
				      "would pass 1 GiB", 0);

	int memfd = memfd_create("railwave-rank-page", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	void *map = MAP_FAILED;
	if (memfd < 0 || ftruncate(memfd, (off_t)l.bytes) < 0 ||
	    fcntl(memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0 ||
	    (map = mmap(NULL, l.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0)) == MAP_FAILED) {
		rw_err("ipc: client=%u: cannot make its rank page of %llu bytes: %m", c->info.id,
		       (unsigned long long)l.bytes);
		if (memfd >= 0)
			close(memfd);
		return ipc_send_error(c, seq, RW_E_INTERNAL, "the daemon could not make the rank page",
				      0);
	}
	rw_page_init(map, nodes, cfg->page_rails, c->srv->lim.max_tokens, req->max_recv, &l);

	rw_ipc_page_ok_t ok;
	memset(&ok, 0, sizeof(ok));
	ipc_hdr_init(&ok.hdr, RW_IPC_PAGE_OK, seq);
	ok.bytes = l.bytes;
	ok.slot0 = l.slot0;
	ok.slot_bytes = l.slot_bytes;
	ok.nodes = nodes;
	ok.rails = cfg->page_rails;
	int rc = ipc_send_msg(c, &ok, sizeof(ok), &memfd, 1);
	close(memfd);
	if (rc) {
		munmap(map, l.bytes);
		return rc;
	}
	c->page = map;
	c->page_bytes = l.bytes;
	return 0;
}
