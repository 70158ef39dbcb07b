"""librailwave's rank path for a Group (docs/rankpath.md; docs/python.md "The rank path"): the
kernels run in this process on the caller's current stream (torch.cuda.current_stream()), the
daemon plans and moves the records, and hand-offs are words in the rank page. This module owns
the rw_client_rank_t of one Group: when it is used (RAILWAVE_RANK_PATH), opening it, the stream
argument, and waiting for a phase; railwave._core builds the dispatch and combine on it.

Test-only: CI has no GPU, so RAILWAVE_TEST_HOST_AS_DEVICE=1 lets CPU tensors stand for device
memory on the project's kernel stand-in driver (tests/integration/libfakecuda_kern.so, whose
"device pointers" are host addresses). It is honoured only while RW_CUDA_DRIVER names that
stand-in; anywhere else setting it is refused at Group creation, so it can never send a host
address to a real GPU."""
import ctypes
import os
import time

from . import _lib
from .errors import CODES, BadArgument, RailWaveError

STAND_IN = "libfakecuda_kern"  # the kernel stand-in driver's file name (tests/integration/)
_TIMEOUT = CODES["RW_E_TIMEOUT"]


def mode(env=os.environ) -> int:
    """RAILWAVE_RANK_PATH: 0 never, 1 always (a Group whose rank path cannot open fails), -1
    (unset or empty) wherever it opens, else the ring path."""
    v = env.get("RAILWAVE_RANK_PATH", "")
    if v == "":
        return -1
    if v not in ("0", "1"):
        raise BadArgument("Group", "RAILWAVE_RANK_PATH=%r: 0 (the ring path), 1 (the rank "
                          "path) or unset (the rank path where it opens)" % v)
    return int(v)


def host_as_device(env=os.environ) -> bool:
    """The test-only switch (this module's docstring)."""
    if env.get("RAILWAVE_TEST_HOST_AS_DEVICE", "") in ("", "0"):
        return False
    drv = os.path.basename(env.get("RW_CUDA_DRIVER", ""))
    if not drv.startswith(STAND_IN):
        raise BadArgument("Group", "RAILWAVE_TEST_HOST_AS_DEVICE is a test switch for the "
                          "kernel stand-in driver (RW_CUDA_DRIVER=.../%s.so); with the driver "
                          "%r it would hand host addresses to a GPU" % (STAND_IN, drv or
                                                                        "libcuda.so.1"))
    return True


class RankPath:
    """One Group's rank path on one device: opened with the Group's receive room (max_recv, the
    records one dispatch may deliver to this rank: the daemon fails a phase that would list
    more), and cap, the rows every dispatch's outputs are sized for (max_recv, or less in
    static mode: rows listed past it are dropped and counted on the device). host: CPU
    tensors stand for device memory (the test switch), on the legacy stream."""

    def __init__(self, lib, client, device, max_recv, host, static=False, cap=None, sms=0):
        self.lib, self.device, self.max_recv, self.host = lib, device, max_recv, host
        self.cap = min(cap or max_recv, max_recv)
        self.static = static
        self.waited = 0.0  # seconds spent blocked in reap (python/bench/overhead.py)
        rp = ctypes.c_void_p(0)
        if sms:  # the SM budget: the options' open (a library without it refused it earlier)
            opts = _lib.RankOpts(max_recv=max_recv, max_sms=sms,
                                 flags=_lib.RANK_OPEN_STATIC if static else 0)
            rc = lib.rw_client_rank_open_opts(client, device, ctypes.byref(opts),
                                              ctypes.byref(rp))
        else:
            op = lib.rw_client_rank_open_static if static else lib.rw_client_rank_open
            rc = op(client, device, max_recv, ctypes.byref(rp))
        if rc:
            self.rp = None
            raise _lib.error(rc, "open the rank path%s on device %d (max_recv %d%s)"
                             % (" in static mode" if static else "", device, max_recv,
                                ", max_sms %d" % sms if sms else ""),
                             lib.rw_client_rank_message(None).decode())
        self.rp = rp
        slab, dptr = _lib.ClientSlab(), ctypes.c_uint64(0)
        rc = lib.rw_client_rank_slab(rp, 0, ctypes.byref(slab), ctypes.byref(dptr))
        if rc:  # the daemon lends this group no slabs: its dispatches would all be refused
            msg = lib.rw_client_rank_message(rp).decode()
            self.close()
            raise _lib.error(rc, "open the rank path: the daemon lends this group no slabs "
                             "(group_area_mib 0, or its pool was spent)", msg)
        self.stream = _lib.ClientStream(device, 0, 0)
        self.stream_ref = ctypes.byref(self.stream)
        self.done = _lib.RankDone()
        self.done_ref = ctypes.byref(self.done)
        self.phase = ctypes.c_uint64(0)
        self.phase_ref = ctypes.byref(self.phase)
        self._wait = lib.rw_client_rank_wait

    def set_sms(self, sms):
        """rw_client_rank_set_sms: the SM budget of the calls enqueued from now on."""
        rc = self.lib.rw_client_rank_set_sms(self.rp, sms)
        if rc:
            raise _lib.error(rc, "set the rank path's SM budget to %d" % sms, self.message(),
                             BadArgument)

    def message(self) -> str:
        return self.lib.rw_client_rank_message(self.rp).decode() if self.rp else ""

    def reap(self, group, work, block, timeout=None):
        """How phase work.phase_id ended: (code, rows received, rows dropped, the library's
        message), or None when not blocking and the stream has not written its done yet.
        Waiting busy-polls the page for the Group's spin_us, then sleeps in steps from 20 µs
        doubling to 200 µs (no system call can tell the stream's progress; the library's own
        wait would yield in a loop and take a core from the daemon on a small host)."""
        k, wait, ref = work.phase_id, self._wait, self.done_ref
        rc = wait(self.rp, k, 0, ref)
        if rc == _TIMEOUT:
            if not block:
                return None
            t0 = time.perf_counter()
            limit = group.timeout if timeout is None else timeout
            deadline = time.monotonic() + limit
            spin_end, nap = t0 + group.spin, 20e-6
            while rc == _TIMEOUT:
                if time.perf_counter() >= spin_end:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self.waited += time.perf_counter() - t0
                        raise group._error(
                            _TIMEOUT, work.op, detail="the stream did not finish the phase in "
                            "%.1f s (still in flight: wait() again or close())" % limit)
                    time.sleep(min(nap, left))
                    nap = min(2 * nap, 2e-4)
                rc = wait(self.rp, k, 0, ref)
            self.waited += time.perf_counter() - t0
        d = self.done
        return rc, d.recv_tokens, d.overflow, self.message() if rc else ""

    def sync(self, torch, device):
        """Wait for the stream's work so far: the current stream of device, or for the
        stand-in's host tensors its legacy stream (cuStreamSynchronize through the driver
        librailwave loaded, named by RW_CUDA_DRIVER)."""
        if not self.host:
            torch.cuda.current_stream(device).synchronize()
            return
        if getattr(self, "_drv", None) is None:
            self._drv = ctypes.CDLL(os.environ["RW_CUDA_DRIVER"])
            self._drv.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
        self._drv.cuStreamSynchronize(None)

    def check(self):
        """rw_client_rank_check: (code, the report, the library's message)."""
        c = _lib.RankCheck()
        rc = self.lib.rw_client_rank_check(self.rp, ctypes.byref(c))
        return rc, c, self.message() if rc else ""

    def settle(self, timeout):
        """Before close: let the phase on the stream finish (the stream may still write the page
        until it did), for at most timeout seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            k = self.phase.value
            if self.static or not k or self._wait(self.rp, k, 0, None) != _TIMEOUT:
                return
            time.sleep(1e-3)

    def close(self):
        if self.rp:
            self.lib.rw_client_rank_close(self.rp)
            self.rp = None


def open_for(core, device, max_recv, host, static=False, cap=None, sms=0):
    """The Group's RankPath on device, or None where the ring path serves it: RAILWAVE_RANK_PATH
    unset and the rank path does not open (no driver, kernels or stream memory operations; no
    rank page or slabs from the daemon; a library without it). With RAILWAVE_RANK_PATH=1 that
    is an error. core._rank_off keeps why it fell back."""
    forced = core._rank_mode == 1 or static
    if not getattr(core._lib, "rank_static" if static else "rank_path", False):
        why = "librailwave %s has no rank path%s" % (_lib.path, " static mode" if static else "")
        if forced:
            raise RailWaveError(core._where("open the rank path"), why)
        core._rank_off = why
        return None
    if sms and not core._lib.rank_sms:
        raise BadArgument(core._where("open the rank path"), "num_sms %d: librailwave %s has "
                          "no SM budget (rw_client_rank_open_opts)" % (sms, _lib.path))
    try:
        return RankPath(core._lib, core._c, device, max_recv, host, static, cap, sms)
    except RailWaveError as e:
        if forced or (sms and e.code == CODES["RW_E_INVAL"]):  # a bad budget is the caller's
            raise
        core._rank_off = str(e)
        return None
