"""CUDA tensors for railwaved: the IPC handle of the allocation a tensor lives in, plus its
offset. PyTorch's caching allocator carves many tensors out of one cudaMalloc segment, and
cuIpcGetMemHandle works on whole segments only, so one registration per segment serves every
tensor in it (docs/python.md "Buffer lifetime"). A segment is known by its
CU_POINTER_ATTRIBUTE_BUFFER_ID: when the allocator frees a segment and a new one lands at the
same address, the id differs and the stale registration is replaced.

The driver is reached with ctypes (libcuda.so.1), never linked: the package works on CPU-only
nodes. Needs a GPU to run; tests/python/test_moe.py's `cuda` scenario exercises it there."""
import ctypes

from . import _lib
from .errors import BadArgument, CudaError

CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
CU_POINTER_ATTRIBUTE_BUFFER_ID = 7
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
CU_MEMORYTYPE_DEVICE = 2


class _Driver:
    def __init__(self):
        self.cu = ctypes.CDLL("libcuda.so.1")
        u64p = ctypes.POINTER(ctypes.c_uint64)
        self.cu.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
        self.cu.cuMemGetAddressRange_v2.argtypes = [u64p, ctypes.POINTER(ctypes.c_size_t),
                                                    ctypes.c_uint64]
        self.cu.cuIpcGetMemHandle.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
        self.cu.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        self.cu.cuDeviceGetUuid.argtypes = [ctypes.c_void_p, ctypes.c_int]

    def check(self, res, what):
        if res != 0:
            raise CudaError(what, "CUDA driver call failed (CUresult %d)" % res)

    def attr(self, ptr, attr, ctype):
        v = ctype(0)
        self.check(self.cu.cuPointerGetAttribute(ctypes.byref(v), attr, ptr),
                   "cuPointerGetAttribute(%d)" % attr)
        return v.value

    def segment(self, ptr):
        """(base, size, buffer id, device ordinal) of the allocation holding ptr."""
        if self.attr(ptr, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ctypes.c_uint) != CU_MEMORYTYPE_DEVICE:
            raise BadArgument("lend a CUDA tensor", "0x%x is not CUDA device memory" % ptr)
        base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
        self.check(self.cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr),
                   "cuMemGetAddressRange")
        bid = self.attr(base.value, CU_POINTER_ATTRIBUTE_BUFFER_ID, ctypes.c_ulonglong)
        dev = self.attr(ptr, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ctypes.c_int)
        return base.value, size.value, bid, dev

    def describe(self, base, size, bid, dev):
        d = _lib.CudaDesc()
        h = (ctypes.c_uint8 * 64)()
        res = self.cu.cuIpcGetMemHandle(ctypes.byref(h), base)
        if res != 0:
            raise CudaError(
                "cuIpcGetMemHandle", "failed (CUresult %d): the tensor's memory is not "
                "IPC-exportable (expandable segments or a memory pool? set "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False)" % res)
        ctypes.memmove(d.ipc_handle, h, 64)
        d.alloc_id, d.alloc_bytes, d.offset, d.bytes, d.device = bid, size, 0, size, dev
        cudev = ctypes.c_int(0)
        self.check(self.cu.cuDeviceGet(ctypes.byref(cudev), dev), "cuDeviceGet")
        self.check(self.cu.cuDeviceGetUuid(ctypes.byref(d.device_uuid), cudev.value),
                   "cuDeviceGetUuid")
        return d


class CudaRegistry:
    """The CUDA segments one Group lent its daemon: base address → (buffer id, railwave buf_id)."""

    def __init__(self, client, lib):
        self.client, self.lib = client, lib
        self.drv = None
        self.segs = {}

    def span(self, tensor):
        """(buf_id, offset) of a CUDA tensor's first byte, registering its segment if new."""
        if self.drv is None:
            self.drv = _Driver()
        ptr = tensor.data_ptr()
        base, size, bid, dev = self.drv.segment(ptr)
        have = self.segs.get(base)
        if have and have[0] == bid and have[2] == size:
            return have[1], ptr - base
        if have:  # the allocator reused the address for a new segment
            self.lib.rw_client_deregister(self.client, have[1])
            del self.segs[base]
        desc = self.drv.describe(base, size, bid, dev)
        buf = ctypes.c_uint32(0)
        rc = self.lib.rw_client_register_cuda(self.client, ctypes.byref(desc), ctypes.byref(buf))
        if rc:
            raise _lib.error(rc, "register CUDA segment 0x%x (%d bytes, device %d)"
                             % (base, size, dev),
                             self.lib.rw_client_last_message(self.client).decode())
        self.segs[base] = (bid, buf.value, size)
        return buf.value, ptr - base

    def release(self):
        for _, buf, _ in self.segs.values():
            self.lib.rw_client_deregister(self.client, buf)
        self.segs = {}


CU_EVENT_DISABLE_TIMING, CU_EVENT_INTERPROCESS = 0x2, 0x4
CU_STREAM_WAIT_VALUE_GEQ = 0x0


class StreamOrder:
    """Stream-ordered submission for one Group on one device (ipc/railwave.h "Stream-ordered
    submission"; docs/python.md "Stream order"): an interprocess event the daemon's streams wait
    on before reading a submission's inputs, recorded on the caller's current stream, and a
    4-byte flag (a torch int32 tensor, lent like any CUDA tensor) the daemon sets to the
    submission's value V once its outputs are written; the caller's stream waits for it
    (cuStreamWaitValue32, GEQ: cyclic). One submission at a time per Group, so the event is never
    re-recorded before the daemon's wait on it was enqueued."""

    def __init__(self, registry, device):
        drv = registry.drv if registry.drv is not None else _Driver()
        registry.drv = drv
        cu = self.cu = drv.cu
        cu.cuEventCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        cu.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        cu.cuEventDestroy_v2.argtypes = [ctypes.c_void_p]
        cu.cuIpcGetEventHandle.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        cu.cuStreamWaitValue32_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32,
                                              ctypes.c_uint]
        import torch
        self.torch, self.device = torch, device
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)
        self.value = 0
        self.ev = ctypes.c_void_p(0)
        with torch.cuda.device(device):
            drv.check(cu.cuEventCreate(ctypes.byref(self.ev),
                                       CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING),
                      "cuEventCreate(interprocess)")
        h = (ctypes.c_uint8 * 64)()
        drv.check(cu.cuIpcGetEventHandle(ctypes.byref(h), self.ev), "cuIpcGetEventHandle")
        buf, off = registry.span(self.flag)
        self.lib, self.client = registry.lib, registry.client
        eid = ctypes.c_uint32(0)
        rc = self.lib.rw_client_register_event(self.client, h, buf, off, ctypes.byref(eid))
        if rc:
            drv.check(cu.cuEventDestroy_v2(self.ev), "cuEventDestroy")
            raise _lib.error(rc, "register a stream-order event on %s" % device,
                             self.lib.rw_client_last_message(self.client).decode())
        self.id, self.buf, self.off = eid.value, buf, off

    def before_submit(self, sqe):
        """Record the event behind the current stream's work (the inputs) and mark sqe to wait
        on it and to signal the next value."""
        s = self.torch.cuda.current_stream(self.device)
        res = self.cu.cuEventRecord(self.ev, ctypes.c_void_p(s.cuda_stream))
        if res != 0:
            raise CudaError("cuEventRecord", "failed (CUresult %d)" % res)
        self.value = (self.value + 1) & 0xFFFFFFFF
        sqe.flags = _lib.SQE_WAIT_EVENT | _lib.SQE_SIGNAL
        sqe.event_id = self.id
        sqe.output.reserved = self.value

    def after_submit(self):
        """Work enqueued on the current stream from now on runs once the daemon set the flag."""
        s = self.torch.cuda.current_stream(self.device)
        res = self.cu.cuStreamWaitValue32_v2(ctypes.c_void_p(s.cuda_stream),
                                             self.flag.data_ptr(), self.value,
                                             CU_STREAM_WAIT_VALUE_GEQ)
        if res != 0:
            raise CudaError("cuStreamWaitValue32", "failed (CUresult %d)" % res)

    def pay_lost(self):
        """The daemon is gone: write every flag value it still owed, from a side stream (the
        current one may be waiting on the flag), so no stream waits forever. Returns how many."""
        out = (_lib.LostSignal * 16)()
        n_all = 0
        while True:
            n = self.lib.rw_client_lost_signals(self.client, out, 16)
            if n <= 0:
                return n_all
            side = self.torch.cuda.Stream(self.device)
            with self.torch.cuda.stream(side):
                for i in range(n):
                    v = out[i].value
                    self.flag.fill_(v - (1 << 32) if v >= (1 << 31) else v)
            side.synchronize()
            n_all += n

    def settle(self):
        """Leaving with an operation in flight (the daemon writes no flag for a rank that left):
        set the flag to the last value asked for, so the current stream does not wait forever."""
        v = self.value
        side = self.torch.cuda.Stream(self.device)
        with self.torch.cuda.stream(side):
            self.flag.fill_(v - (1 << 32) if v >= (1 << 31) else v)
        side.synchronize()

    def release(self):
        if self.ev:
            self.lib.rw_client_deregister_event(self.client, self.id)
            self.cu.cuEventDestroy_v2(self.ev)
            self.ev = ctypes.c_void_p(0)
