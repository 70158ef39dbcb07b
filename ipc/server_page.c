/* The daemon side of the rank page (docs/rankpath.md "The rank page"; layout and word rules in
 * ipc/page.h): made at a joined rank's request, sized for the cluster's nodes and rails and the
 * rank's receive bound, sealed against shrinking, growing and new seals before the rank sees it
 * (as the rings are). The server's word poller (ipc/poller.c) watches the three words the rank
 * writes; each move is judged (rw_page_word_step) and handed to the service (ops.page_word), a
 * bad one drops the rank. A page outlives its client until the poller has retired its watches
 * (it may be reading them when the client leaves), then it is unmapped. Part of ipc/server.c's
 * server (ipc/server_int.h). */
#include "ipc/server_int.h"

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "ipc/page.h"

#define NWATCH 3 /* the words a rank writes */
static const unsigned watched[NWATCH] = { RW_PW_SUBMIT, RW_PW_PACKED, RW_PW_DONE };
static const char *const word_name[RW_PW_COUNT] = { "submit", "plan", "packed", "arrived", "done" };

typedef struct ipc_page {
	struct ipc_page *next;     /* server's list */
	rw_ipc_client_t *client;   /* NULL once it left */
	void *map;
	size_t bytes;
	rw_page_geom_t geom;       /* what it was made for (the rank may rewrite the head) */
	uint32_t id[NWATCH];       /* poller watch ids */
	uint64_t seen[NWATCH];     /* last value accepted */
	unsigned live;             /* watches not yet retired */
} ipc_page_t;

static void page_unmap(rw_ipc_server_t *srv, ipc_page_t *p)
{
	for (ipc_page_t **pp = &srv->pages; *pp; pp = &(*pp)->next)
		if (*pp == p) {
			*pp = p->next;
			break;
		}
	munmap(p->map, p->bytes);
	free(p);
}

/* The poller's report, on the loop. */
static void page_word_moved(void *ctx, uint32_t id, uint64_t value, int retired)
{
	rw_ipc_server_t *srv = ctx;
	ipc_page_t *p = srv->by_watch[id];
	if (!p)
		return;
	if (retired) {
		srv->by_watch[id] = NULL;
		if (--p->live == 0)
			page_unmap(srv, p);
		return;
	}
	rw_ipc_client_t *c = p->client;
	unsigned j = 0;
	while (j < NWATCH && p->id[j] != id)
		j++;
	if (!c || c->dying || j == NWATCH)
		return;
	int step = rw_page_word_step(p->seen[j], value);
	if (step == RW_PAGE_SAME)
		return;
	if (step == RW_PAGE_BAD) {
		char why[128];
		snprintf(why, sizeof(why), "rank page word %s went from %llu to %llu (forward by 1 "
			 "to %u only)", word_name[watched[j]], (unsigned long long)p->seen[j],
			 (unsigned long long)value, RW_PAGE_DEPTH);
		rw_warn("ipc: client=%u group=%s rank=%u: %s: dropping it", c->info.id, c->info.group,
			c->info.rank, why);
		ipc_send_error(c, 0, RW_E_RING_INDEX, why, 1); /* the rank hears why */
		ipc_client_kill(c, RW_IPC_LEFT_PROTOCOL, RW_E_RING_INDEX); /* also if the send failed */
		return;
	}
	p->seen[j] = value;
	if (srv->ops.page_word)
		srv->ops.page_word(srv->ctx, c, watched[j], value);
}

rw_status_t ipc_pages_start(rw_ipc_server_t *srv)
{
	if (srv->cfg.page_rails == 0)
		return RW_OK;
	const uint32_t clients = srv->cfg.max_clients ? srv->cfg.max_clients : 256;
	rw_ipc_poller_config_t pc = { .spin_us = RW_IPC_POLLER_SPIN_US,
				      .yield_us = RW_IPC_POLLER_YIELD_US,
				      .sleep_min_us = RW_IPC_POLLER_SLEEP_MIN_US,
				      .sleep_max_us = RW_IPC_POLLER_SLEEP_MAX_US,
				      .busy_sleep_max_us = RW_IPC_POLLER_BUSY_SLEEP_MAX_US,
				      .loop_waits = 1 };
	if (srv->cfg.poller)
		pc = *srv->cfg.poller;
	pc.max_watches = clients * NWATCH;
	srv->by_watch = calloc(pc.max_watches, sizeof(*srv->by_watch));
	if (!srv->by_watch)
		return RW_ERR_NOMEM;
	rw_status_t st = rw_ipc_poller_create(srv->loop, &pc, page_word_moved, srv, &srv->poller);
	if (st != RW_OK) {
		if (st == RW_ERR_INVAL)
			rw_err("ipc: the word poller's schedule is out of range (spin %u us, yield %u us, "
			       "sleeps %u..%u us, %u us while busy)", pc.spin_us, pc.yield_us,
			       pc.sleep_min_us, pc.sleep_max_us, pc.busy_sleep_max_us);
		free(srv->by_watch);
		srv->by_watch = NULL;
	}
	return st;
}

void rw_ipc_server_pages_busy(rw_ipc_server_t *srv, int busy)
{
	if (!srv->poller)
		return;
	rw_ipc_poller_busy(srv->poller, busy);
	srv->pages_busy += busy ? 1 : -1;
}

void ipc_pages_prepare(rw_ipc_server_t *srv)
{
	if (srv->pages_busy > 0)
		rw_ipc_poller_kick(srv->poller);
}

void ipc_pages_stop(rw_ipc_server_t *srv)
{
	rw_ipc_poller_destroy(srv->poller); /* joined: nothing reads a page after this */
	srv->poller = NULL;
	while (srv->pages)
		page_unmap(srv, srv->pages);
	free(srv->by_watch);
	srv->by_watch = NULL;
}

void ipc_page_free(rw_ipc_client_t *c)
{
	ipc_page_t *p = c->page;
	if (!p)
		return;
	c->page = NULL;
	p->client = NULL;
	for (unsigned j = 0; j < NWATCH; j++)
		rw_ipc_poller_unwatch(c->srv->poller, p->id[j]);
}

void *rw_ipc_client_page(const rw_ipc_client_t *c, size_t *bytes_p)
{
	if (bytes_p)
		*bytes_p = c->page ? c->page->bytes : 0;
	return c->page ? c->page->map : NULL;
}

const rw_page_geom_t *rw_ipc_client_page_geom(const rw_ipc_client_t *c)
{
	return c->page ? &c->page->geom : NULL;
}

/* Watch the rank's words; on failure nothing is watched. */
static rw_status_t page_watch(rw_ipc_server_t *srv, ipc_page_t *p)
{
	rw_page_head_t *pg = p->map;
	for (unsigned j = 0; j < NWATCH; j++) {
		rw_status_t st = rw_ipc_poller_watch(srv->poller, &pg->word[watched[j]].v, &p->id[j]);
		if (st != RW_OK) {
			while (j-- > 0) { /* their retired reports find no page */
				srv->by_watch[p->id[j]] = NULL;
				rw_ipc_poller_unwatch(srv->poller, p->id[j]);
			}
			return st;
		}
		srv->by_watch[p->id[j]] = p;
	}
	p->live = NWATCH;
	return RW_OK;
}

int ipc_page_setup(rw_ipc_client_t *c, const rw_ipc_page_setup_t *req)
{
	const uint32_t seq = req->hdr.seq;
	const rw_ipc_server_config_t *cfg = &c->srv->cfg;
	if (c->page)
		return ipc_send_error(c, seq, RW_E_STATE, "rank page already set up", 0);
	if (!c->srv->poller || cfg->world_size == 0 || cfg->gpus_per_node == 0)
		return ipc_send_error(c, seq, RW_E_STATE, "this daemon lends no rank page (no rails "
				      "or cluster geometry configured for it)", 0);
	const uint32_t bound = cfg->page_max_recv ? cfg->page_max_recv : c->srv->lim.max_tokens;
	if (req->max_recv == 0 || req->max_recv > bound)
		return ipc_send_error(c, seq, RW_E_TOKENS, "page setup: max_recv 0 or above the "
				      "daemon's bound on records a rank receives in one phase", 0);
	const uint32_t nodes = cfg->world_size / cfg->gpus_per_node;
	rw_page_layout_t l;
	if (rw_page_layout(nodes, cfg->page_rails, cfg->gpus_per_node, req->max_recv,
			   (size_t)sysconf(_SC_PAGESIZE), &l))
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
	const rw_page_geom_t geom = { .nodes = nodes, .rails = cfg->page_rails,
				      .gpus = cfg->gpus_per_node, .max_tokens = c->srv->lim.max_tokens,
				      .max_recv = req->max_recv };
	/* The rank's local index is its place on the node (rank % GPUs per node), as the service
	 * counts it and checks its count row's rail and its records' owner: never the hello's
	 * local GPU, which the rank chooses (-1, or another index). */
	const uint32_t g = c->info.rank % cfg->gpus_per_node;
	const uint32_t rail = cfg->page_gpu_rail ? cfg->page_gpu_rail[g] : g % cfg->page_rails;
	rw_page_init(map, &geom, rail, &l);
	((rw_page_head_t *)map)->node = c->info.node;
	((rw_page_head_t *)map)->owner = g;

	rw_ipc_page_ok_t ok;
	memset(&ok, 0, sizeof(ok));
	ipc_hdr_init(&ok.hdr, RW_IPC_PAGE_OK, seq);
	ok.bytes = l.bytes;
	ok.slot0 = l.slot0;
	ok.slot_bytes = l.slot_bytes;
	ok.nodes = nodes;
	ok.rails = cfg->page_rails;
	ipc_page_t *p = calloc(1, sizeof(*p));
	if (p) {
		p->map = map;
		p->bytes = l.bytes;
		p->geom = geom;
	}
	if (!p || page_watch(c->srv, p) != RW_OK) {
		free(p);
		munmap(map, l.bytes);
		close(memfd);
		return ipc_send_error(c, seq, RW_E_LIMIT, "the daemon watches too many rank pages", 0);
	}
	p->client = c;
	p->next = c->srv->pages;
	c->srv->pages = p;
	c->page = p;
	int rc = ipc_send_msg(c, &ok, sizeof(ok), &memfd, 1);
	close(memfd);
	return rc; /* a failed send killed the client: its teardown retires the page */
}
