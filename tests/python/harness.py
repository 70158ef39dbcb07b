"""Shared pieces of the Python test scripts: the skip when torch is missing, and a rank
process's command loop (one JSON command per line in, one JSON answer per line out)."""
import json
import sys
import traceback


def torch_or_skip():
    """Imported torch, or None after printing the skip line (exit 77 then)."""
    try:
        import torch
    except ImportError:
        print("skip: no torch for %s (Debian: python3-torch, installed by scripts/setup)"
              % sys.executable)
        return None
    return torch


def serve(commands, stream=sys.stdin):
    """Answer each command line with {"ok": true, "log": commands[op](command)} or
    {"ok": false, "error": what was raised, with its traceback's end}."""
    for line in stream:
        cmd = json.loads(line)
        try:
            reply = {"ok": True, "log": commands[cmd["op"]](cmd)}
        except Exception as e:
            reply = {"ok": False, "error": "%s: %s\n%s" % (type(e).__name__, e,
                                                           traceback.format_exc()[-1500:])}
        print(json.dumps(reply), flush=True)
