#!/usr/bin/env python3
"""Write the seed corpus of tests/fuzz/fuzz_parsers.c into tests/fuzz/corpus/ (run from the
repository root). A seed is a selector byte (high nibble: 0 peer wire, 1 tcp rail header, 2
configuration, 3 anchor table; low nibble for the wire: which decoder) and the parser's input:
valid messages built from the layouts in service/phase/wire.h and rdma/tcp_wire.h, and the shipped
cluster files and anchor table."""
import glob
import os
import re
import struct


def define(path, name):
    with open(path) as f:
        m = re.search(r"#define %s (\w+)" % name, f.read())
    return int(m.group(1), 0)


WIRE_VERSION = define("service/phase/wire.h", "RW_WIRE_VERSION")
ERRMSG = define("service/phase/wire.h", "RW_WIRE_ERRMSG_MAX")
TCP_MAGIC, TCP_VERSION = 0x43545752, define("rdma/tcp_wire.h", "RW_TCP_VERSION")


def key(group=7, layer=1, step=2):
    return struct.pack("<IIQ", group, layer, step)


def seeds():
    yield "wire_hdr", bytes([0]) + struct.pack("<IHHII", 0x434D5752, WIRE_VERSION, 2, 64, 9)
    yield "wire_phase_err", bytes([3]) + key() + struct.pack("<IiIIIII", 0, -9, 1, 77, 1, 77, 5) + \
        b"node 1 (n1): timed out".ljust(ERRMSG, b"\0")
    yield "wire_grant", bytes([4]) + key() + struct.pack("<II", 0, 2)
    yield "wire_heartbeat", bytes([5]) + struct.pack("<QQQ", 1, 2, 3)
    yield "wire_hello", bytes([1]) + b"lab".ljust(64, b"\0") + struct.pack("<IIIIQQII", 0, 2, 1, 2, 5, 6, 1, 0) + \
        bytes(range(32))
    yield "wire_regions", bytes([6]) + struct.pack("<II", 2, 0) + \
        b"".join(bytes([r + 1]) * 32 + ("127.0.%d.1:4000" % r).encode().ljust(64, b"\0") for r in range(2))
    yield "wire_rec", bytes([7, 3]) + struct.pack("<IHHIHH", 0xABCD, 1, 0, 5, 4, 0) + bytes(64)
    yield "tcp_write", bytes([0x10]) + struct.pack("<IBBxxII", TCP_MAGIC, TCP_VERSION, 3, 5, 0) + \
        struct.pack("<QQQQ", 1, 0, 4096, 1) + bytes(16)
    yield "tcp_hello", bytes([0x10]) + struct.pack("<IBBxxII", TCP_MAGIC, TCP_VERSION, 1, 0, 0) + \
        struct.pack("<QQ", 1, 0) + bytes(range(32))
    for p in sorted(glob.glob("deploy/clusters/*.json")):
        yield "config_" + os.path.basename(p)[:-5], bytes([0x20]) + open(p, "rb").read()
    for p in sorted(glob.glob("deploy/anchors/*.json")):
        yield "anchors_" + os.path.basename(p)[:-5], bytes([0x30]) + open(p, "rb").read()


def main():
    os.makedirs("tests/fuzz/corpus", exist_ok=True)
    for name, data in seeds():
        with open(os.path.join("tests/fuzz/corpus", name), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main()
