"""ctypes face of librailwave.so (ipc/railwave.h): the structs of the ring ABI and the client
functions, and error() which turns an RW_E_* code into its railwave.errors exception. Nothing here
knows torch; railwave._core builds on it.

Which library: $RAILWAVE_LIB (a file, or a folder holding librailwave.so.1), else the copy that
`pip install ./python` bundled into this package, else a build tree above this file (running from
a source checkout with PYTHONPATH=python), else the system's (ld.so: /etc/ld.so.conf,
$LD_LIBRARY_PATH)."""
import ctypes
import os

from . import errors

SONAME = "librailwave.so.1"

# Wire values of ipc/railwave.h (tests/python/test_package.py checks them against the header).
KIND_DISPATCH, KIND_COMBINE = 1, 2
DTYPE_BF16, DTYPE_FP16, DTYPE_FP8, DTYPE_FP32 = 1, 2, 3, 4
BUF_NONE = 0xFFFFFFFF
CQ_OK = 0
CQE_INLINE_COUNTS = 16
GROUP_NAME_MAX = 64
DEFAULT_SOCKET = "/run/railwave/railwaved.sock"


class Span(ctypes.Structure):
    _fields_ = [("buf_id", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
                ("offset", ctypes.c_uint64)]


class Sqe(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_uint8), ("dtype", ctypes.c_uint8), ("topk", ctypes.c_uint16),
                ("layer", ctypes.c_uint32), ("phase_id", ctypes.c_uint64),
                ("step", ctypes.c_uint64), ("user_data", ctypes.c_uint64),
                ("token_count", ctypes.c_uint32), ("hidden", ctypes.c_uint32),
                ("handle_id", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("tokens", Span), ("topk_ids", Span), ("topk_weights", Span), ("output", Span),
                ("output_capacity", ctypes.c_uint64), ("n_experts", ctypes.c_uint32),
                ("event_id", ctypes.c_uint16), ("path", ctypes.c_uint16)]


class Cqe(ctypes.Structure):
    _fields_ = [("status", ctypes.c_uint8), ("kind", ctypes.c_uint8), ("n_inline", ctypes.c_uint8),
                ("reserved0", ctypes.c_uint8), ("error", ctypes.c_int32),
                ("phase_id", ctypes.c_uint64), ("user_data", ctypes.c_uint64),
                ("recv_tokens", ctypes.c_uint32), ("handle_id", ctypes.c_uint32),
                ("counts_buf", ctypes.c_uint32), ("n_experts", ctypes.c_uint32),
                ("counts_offset", ctypes.c_uint64),
                ("counts", ctypes.c_uint32 * CQE_INLINE_COUNTS), ("reserved", ctypes.c_uint8 * 16)]


class LostSignal(ctypes.Structure):
    _fields_ = [("event_id", ctypes.c_uint32), ("value", ctypes.c_uint32),
                ("flag_buf", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
                ("flag_offset", ctypes.c_uint64), ("phase_id", ctypes.c_uint64),
                ("user_data", ctypes.c_uint64)]


# rw_sqe_t.flags (railwave.h "Stream-ordered submission", "Failing a pair by its key")
SQE_WAIT_EVENT, SQE_SIGNAL, SQE_ABORT = 1, 2, 4


class Opts(ctypes.Structure):
    _fields_ = [("socket_path", ctypes.c_char_p), ("group", ctypes.c_char_p),
                ("rank", ctypes.c_uint32), ("world_size", ctypes.c_uint32),
                ("node", ctypes.c_uint32), ("local_gpu", ctypes.c_int32),
                ("gpu_uuid", ctypes.c_uint8 * 16), ("sq_entries", ctypes.c_uint32),
                ("cq_entries", ctypes.c_uint32), ("timeout_ms", ctypes.c_int)]


class CudaDesc(ctypes.Structure):
    _fields_ = [("ipc_handle", ctypes.c_uint8 * 64), ("alloc_id", ctypes.c_uint64),
                ("alloc_bytes", ctypes.c_uint64), ("offset", ctypes.c_uint64),
                ("bytes", ctypes.c_uint64), ("device_uuid", ctypes.c_uint8 * 16),
                ("device", ctypes.c_int32)]


# The rank path (ipc/railwave.h "The rank path"): a stream, one dispatch, one combine, how a
# phase ended, and a group slab as rw_client_rank_slab gives it.
class ClientStream(ctypes.Structure):
    _fields_ = [("device", ctypes.c_int32), ("reserved", ctypes.c_uint32),
                ("handle", ctypes.c_uint64)]


class RankDispatch(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_uint8), ("reserved0", ctypes.c_uint8),
                ("topk", ctypes.c_uint16), ("layer", ctypes.c_uint32), ("step", ctypes.c_uint64),
                ("token_count", ctypes.c_uint32), ("hidden", ctypes.c_uint32),
                ("n_experts", ctypes.c_uint32), ("path", ctypes.c_uint16),
                ("reserved1", ctypes.c_uint16), ("tokens", ctypes.c_uint64),
                ("topk_ids", ctypes.c_uint64), ("topk_weights", ctypes.c_uint64),
                ("recv_x", ctypes.c_uint64), ("recv_meta", ctypes.c_uint64),
                ("recv_counts", ctypes.c_uint64), ("recv_cap", ctypes.c_uint32),
                ("reserved2", ctypes.c_uint32)]


class RankCombine(ctypes.Structure):
    _fields_ = [("dispatch", ctypes.c_uint64), ("rows", ctypes.c_uint64),
                ("out", ctypes.c_uint64)]


class RankDone(ctypes.Structure):
    _fields_ = [("recv_tokens", ctypes.c_uint32), ("overflow", ctypes.c_uint32)]


class RankOpts(ctypes.Structure):
    """rw_client_rank_opts_t: zeroed, then filled (a reserved word must stay 0)."""
    _fields_ = [("max_recv", ctypes.c_uint32), ("max_sms", ctypes.c_int32),
                ("flags", ctypes.c_uint32), ("reserved", ctypes.c_uint32 * 5)]


RANK_OPEN_STATIC = 1  # RW_RANK_OPEN_STATIC
RANK_ABORT_ARGUMENT = 1  # RW_RANK_ABORT_ARGUMENT: the combine's arguments were refused
RANK_ABORT_ROUTING = 2  # RW_RANK_ABORT_ROUTING: a backward's routing is not its forward's


class RankCheck(ctypes.Structure):
    _fields_ = [("done", ctypes.c_uint64), ("phase", ctypes.c_uint64),
                ("over_phase", ctypes.c_uint64), ("overflow", ctypes.c_uint32),
                ("need", ctypes.c_uint32)]


class ClientSlab(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("bytes", ctypes.c_size_t),
                ("rail", ctypes.c_uint32), ("rails", ctypes.c_uint32),
                ("area_bytes", ctypes.c_uint64), ("recv_off", ctypes.c_uint64 * 2),
                ("send_off", ctypes.c_uint64 * 2), ("local_off", ctypes.c_uint64),
                ("object", ctypes.c_uint64)]


# The ring ABI (railwave.h's _Static_asserts): a mismatch here would corrupt every submission.
assert ctypes.sizeof(Span) == 16 and ctypes.sizeof(Sqe) == 128 and ctypes.sizeof(Cqe) == 128
assert Sqe.n_experts.offset == 120 and Sqe.event_id.offset == 124 and Sqe.path.offset == 126
assert ctypes.sizeof(LostSignal) == 40
assert ctypes.sizeof(ClientStream) == 16 and ctypes.sizeof(RankDispatch) == 88
assert RankDispatch.recv_cap.offset == 80 and ctypes.sizeof(RankCombine) == 24
assert ctypes.sizeof(RankOpts) == 32


def _candidates():
    env = os.environ.get("RAILWAVE_LIB")
    if env:
        yield os.path.join(env, SONAME) if os.path.isdir(env) else env
        return  # an explicit choice is never silently replaced by another library
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, SONAME)
    d = here
    for _ in range(4):
        d = os.path.dirname(d)
        yield os.path.join(d, "build", "lib", SONAME)
    yield SONAME


def _bind(lib):
    c_p, u32, u32_p = ctypes.c_void_p, ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32)
    sig = {
        "rw_client_strerror": (ctypes.c_char_p, [ctypes.c_int]),
        "rw_client_connect": (ctypes.c_int, [ctypes.POINTER(Opts), ctypes.POINTER(c_p)]),
        "rw_client_close": (None, [c_p]),
        "rw_client_last_message": (ctypes.c_char_p, [c_p]),
        "rw_client_id": (u32, [c_p]),
        "rw_client_register_host": (ctypes.c_int, [c_p, ctypes.c_size_t, u32_p,
                                                   ctypes.POINTER(c_p)]),
        "rw_client_register_cuda": (ctypes.c_int, [c_p, ctypes.POINTER(CudaDesc), u32_p]),
        "rw_client_deregister": (ctypes.c_int, [c_p, u32]),
        "rw_client_submit": (ctypes.c_int, [c_p, ctypes.POINTER(Sqe), ctypes.c_uint]),
        "rw_client_poll": (ctypes.c_int, [c_p, ctypes.POINTER(Cqe), ctypes.c_uint]),
        "rw_client_wait": (ctypes.c_int, [c_p, ctypes.POINTER(Cqe), ctypes.c_uint, ctypes.c_int]),
        "rw_client_inflight": (ctypes.c_uint, [c_p]),
        "rw_client_register_event": (ctypes.c_int, [c_p, ctypes.POINTER(ctypes.c_uint8), u32,
                                                    ctypes.c_uint64, u32_p]),
        "rw_client_deregister_event": (ctypes.c_int, [c_p, u32]),
        "rw_client_lost_signals": (ctypes.c_int, [c_p, ctypes.POINTER(LostSignal),
                                                  ctypes.c_uint]),
    }
    for name, (res, args) in sig.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    u64, u64_p, rank_p = ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p
    rank = {  # a library from before the rank path lacks these: the package then never uses it
        "rw_client_rank_open": (ctypes.c_int, [c_p, ctypes.c_int32, u32,
                                               ctypes.POINTER(c_p)]),
        "rw_client_rank_close": (None, [rank_p]),
        "rw_client_rank_dispatch": (ctypes.c_int, [rank_p, ctypes.POINTER(ClientStream),
                                                   ctypes.POINTER(RankDispatch), u64_p]),
        "rw_client_rank_combine": (ctypes.c_int, [rank_p, ctypes.POINTER(ClientStream),
                                                  ctypes.POINTER(RankCombine), u64_p]),
        "rw_client_rank_wait": (ctypes.c_int, [rank_p, u64, ctypes.c_int,
                                               ctypes.POINTER(RankDone)]),
        "rw_client_rank_slab": (ctypes.c_int, [rank_p, u32, ctypes.POINTER(ClientSlab),
                                               u64_p]),
        "rw_client_rank_message": (ctypes.c_char_p, [rank_p]),
    }
    static = {  # static mode (a later library than the rank path's first)
        "rw_client_rank_open_static": rank["rw_client_rank_open"],
        "rw_client_rank_dispatch_static": (ctypes.c_int, [rank_p, ctypes.POINTER(ClientStream),
                                                          ctypes.POINTER(RankDispatch), u64,
                                                          u64_p]),
        "rw_client_rank_combine_static": rank["rw_client_rank_combine"],
        "rw_client_rank_check": (ctypes.c_int, [rank_p, ctypes.POINTER(RankCheck)]),
    }
    sms = {  # the SM budget (a later library still)
        "rw_client_rank_open_opts": (ctypes.c_int, [c_p, ctypes.c_int32,
                                                    ctypes.POINTER(RankOpts),
                                                    ctypes.POINTER(c_p)]),
        "rw_client_rank_set_sms": (ctypes.c_int, [rank_p, ctypes.c_int32]),
    }
    abort = {  # failing a pair from the rank path (a later library still)
        "rw_client_rank_abort": (ctypes.c_int, [rank_p, ctypes.POINTER(ClientStream), u64, u32,
                                                u64_p]),
    }
    if hasattr(lib, "rw_client_take_notices"):  # the daemon's reasons, read without waiting
        lib.rw_client_take_notices.restype = None
        lib.rw_client_take_notices.argtypes = [c_p]
    lib.rank_path = all(hasattr(lib, name) for name in rank)
    lib.rank_static = lib.rank_path and all(hasattr(lib, name) for name in static)
    lib.rank_sms = lib.rank_path and all(hasattr(lib, name) for name in sms)
    lib.rank_abort = lib.rank_path and all(hasattr(lib, name) for name in abort)
    for table, have in ((rank, lib.rank_path), (static, lib.rank_static),
                        (sms, lib.rank_sms), (abort, lib.rank_abort)):
        for name, (res, args) in table.items() if have else ():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
    return lib


_lib = None
path = None  # the file loaded, once load() ran


def load():
    """The bound library (loaded once). LibraryNotFound (an OSError) listing every place tried
    when none loads."""
    global _lib, path
    if _lib is not None:
        return _lib
    tried = []
    for cand in _candidates():
        if os.sep in cand and not os.path.exists(cand):
            tried.append("%s (absent)" % cand)
            continue
        try:
            lib = ctypes.CDLL(cand)
        except OSError as e:
            tried.append("%s (%s)" % (cand, e))
            continue
        _lib, path = _bind(lib), cand
        return _lib
    raise errors.LibraryNotFound(
        "load %s" % SONAME, "set RAILWAVE_LIB to the library (build/lib/%s after ./configure && "
        "ninja) or install it. Tried: %s" % (SONAME, "; ".join(tried)))


def strerror(code: int) -> str:
    return load().rw_client_strerror(code).decode()


def error(code: int, op: str, detail: str = "",
          default: type = errors.RailWaveError) -> errors.RailWaveError:
    """The exception for RW_E_* code returned while doing op: its class by errors.class_for
    (default: the class of the call's errors), the library's text for the code, detail (what
    the daemon said, or what the package knows)."""
    return errors.class_for(code, default)(op, detail, code=code, text=strerror(code))
