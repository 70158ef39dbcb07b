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
from .errors import RailWaveError

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
            raise RuntimeError("railwave: CUDA driver call %s failed (CUresult %d)" % (what, res))

    def attr(self, ptr, attr, ctype):
        v = ctype(0)
        self.check(self.cu.cuPointerGetAttribute(ctypes.byref(v), attr, ptr),
                   "cuPointerGetAttribute(%d)" % attr)
        return v.value

    def segment(self, ptr):
        """(base, size, buffer id, device ordinal) of the allocation holding ptr."""
        if self.attr(ptr, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ctypes.c_uint) != CU_MEMORYTYPE_DEVICE:
            raise ValueError("railwave: 0x%x is not CUDA device memory" % ptr)
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
            raise RuntimeError(
                "railwave: cuIpcGetMemHandle failed (CUresult %d): the tensor's memory is not "
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
            raise RailWaveError(rc, "register CUDA segment 0x%x (%d bytes, device %d)"
                                % (base, size, dev),
                                self.lib.rw_client_last_message(self.client).decode())
        self.segs[base] = (bid, buf.value, size)
        return buf.value, ptr - base

    def release(self):
        for _, buf, _ in self.segs.values():
            self.lib.rw_client_deregister(self.client, buf)
        self.segs = {}
