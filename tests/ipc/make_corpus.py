#!/usr/bin/env python3
"""Write the seed corpus for tests/ipc/fuzz_ipc.c into tests/ipc/corpus/ (run from the repo root).
Each seed is an op stream (format in fuzz_ipc.c) built from the wire structs of ipc/proto.h."""
import os
import struct

MAGIC, VERSION = 0x50495752, 2
HELLO, REG_HOST, REG_CUDA, DEREG, RING_SETUP, GOODBYE = 1, 3, 4, 6, 8, 10
REG_EVENT, DEREG_EVENT = 12, 13


def hdr(typ, seq, version=VERSION, magic=MAGIC):
    return struct.pack('<IHHII', magic, version, typ, seq, 0)


def hello(group=b'g', rank=0, world=8, node=0, gpu=-1, **kw):
    return hdr(HELLO, 1, **kw) + group.ljust(64, b'\0') + struct.pack('<IIIi', rank, world, node, gpu) + bytes(16)


def keyed(msg, key=b'k' * 32):
    """A hello of the second form: + key_len, reserved, key[64] (docs/ipc.md "Rank authentication")."""
    return msg + struct.pack('<II', len(key), 0) + key.ljust(64, b'\0')


def reg_host(size=4096):
    return hdr(REG_HOST, 2) + struct.pack('<QII', size, 0, 0)


def reg_cuda(handle0=0, offset=0, nbytes=4096, alloc=65536):
    handle = bytes([handle0]) + bytes(63)
    return hdr(REG_CUDA, 3) + handle + struct.pack('<QQQQ', 7, alloc, offset, nbytes) + bytes(16) + struct.pack('<iI', 0, 0)


def dereg(buf_id):
    return hdr(DEREG, 4) + struct.pack('<II', buf_id, 0)


def reg_event(handle0=0, flag_buf=0x100, flag_offset=0):
    """Stream order: an event (the fuzzer's stand-in takes handle byte 0 & 3: 1 = not an event)
    and its flag word."""
    return hdr(REG_EVENT, 7) + bytes([handle0]) + bytes(63) + struct.pack('<IIQ', flag_buf, 0, flag_offset)


def dereg_event(event_id):
    return hdr(DEREG_EVENT, 8) + struct.pack('<II', event_id, 0)


def ring_setup(sq=8, cq=16):
    return hdr(RING_SETUP, 5) + struct.pack('<II', sq, cq)


def goodbye():
    return hdr(GOODBYE, 6)


def send(msg, nfds=0, kind=0):
    return bytes([0, nfds | (kind << 3)]) + struct.pack('<H', len(msg)) + msg


def span(buf, off):
    return struct.pack('<IIQ', buf, 0, off)


def sqe(buf=0x100, phase=2, kind=1, handle=0, tokens=16, hidden=64, topk=2, experts=8, flags=0,
        event=0, value=0):
    body = struct.pack('<BBHIQQQIIII', kind, 1, topk, 0, phase, 0, 0, tokens, hidden, handle, flags)
    body += span(buf, 0) + span(buf, 2048) + span(buf, 2176)
    body += struct.pack('<IIQ', buf, value, 2304)  # output; its reserved word is V with flag 2
    body += struct.pack('<QIHH', 1024, experts if kind == 1 else 0, event, 0)
    assert len(body) == 128
    return body


def entries(*es):
    return bytes([1, len(es)]) + b''.join(es)


def index(which, value):
    return bytes([2, which]) + struct.pack('<I', value)


REAP = bytes([3])

seeds = {
    'hello': send(hello()),
    'bad-version': send(hello(version=1)),
    'hello-key': send(keyed(hello())) + send(ring_setup()) + send(reg_host(), 1, 0)
    + entries(sqe()) + REAP + send(goodbye()),
    'hello-short-key': send(keyed(hello(), b'short')),
    'session': send(hello()) + send(ring_setup()) + send(reg_host(), 1, 0)
    + entries(sqe(), sqe(phase=3), sqe(kind=7)) + REAP + send(dereg(0x100)) + send(goodbye()),
    'combine': send(hello()) + send(ring_setup(4, 2)) + send(reg_host(), 1, 0)
    + entries(sqe(), sqe(phase=4, kind=2, handle=1), sqe(phase=6)) + REAP + entries(sqe(phase=8)),
    'cuda': send(hello()) + send(reg_cuda()) + send(reg_cuda(handle0=2)) + send(ring_setup())
    + entries(sqe(buf=0x100)) + send(dereg(0x100)),
    'fds': send(hello()) + send(reg_host(), 5, 0) + send(reg_host(), 1, 1) + send(reg_host(), 1, 2)
    + send(dereg(1), 1, 3) + send(reg_host(8192), 1, 0),
    'corrupt-sq': send(hello()) + send(ring_setup()) + index(0, 100),
    'corrupt-cq': send(hello()) + send(ring_setup(4, 2)) + send(reg_host(), 1, 0) + index(2, 77)
    + entries(sqe(), sqe(phase=4), sqe(phase=6)),
    'empty-phase': send(hello()) + send(ring_setup()) + send(reg_host(), 1, 0)
    + entries(sqe(tokens=0), sqe(phase=3, tokens=0, experts=0), sqe(phase=5, kind=2, handle=1, tokens=0)),
    'empty-with-fd': send(hello()) + send(b'', 1, 0),  # regression: the fd leaked
    # stream order: events registered (one bad handle, one unaligned flag), flagged entries
    # (the event id known, unknown, missing), the flag's buffer held, the event deregistered
    'stream': send(hello()) + send(reg_cuda()) + send(reg_event()) + send(reg_event(handle0=1))
    + send(reg_event(flag_offset=2)) + send(ring_setup()) + entries(sqe(flags=3, event=0x40, value=5),
    sqe(phase=3, flags=2, event=0x41, value=6), sqe(phase=4, flags=1)) + REAP + send(dereg(0x100))
    + send(dereg_event(0x40)) + send(dereg(0x100)) + send(goodbye()),
    'stream-left': send(hello()) + send(reg_cuda()) + b''.join(send(reg_event(flag_offset=4 * i))
                                                               for i in range(20)),
    'limits': send(hello()) + b''.join(send(reg_host(), 1, 0) for _ in range(5)) + send(ring_setup(3, 8)),
}

out = 'tests/ipc/corpus'
os.makedirs(out, exist_ok=True)
for name, data in seeds.items():
    with open(os.path.join(out, name), 'wb') as f:
        f.write(data)
print(f'{len(seeds)} seeds in {out}')
