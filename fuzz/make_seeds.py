#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz harnesses. Store server: well-formed request streams
in dtrain's dialect and in PyTorch's c10d v1 and v2 (docs/design/store-protocol.md).
Run from the repository root: python3 fuzz/make_seeds.py"""
import gzip
import os
import json
import struct
import zlib



def write_corpus(harness, seeds):
    """Writes fuzz/corpus/<harness>/<name> for each name -> bytes."""
    out = os.path.join(os.path.dirname(__file__), "corpus", harness)
    os.makedirs(out, exist_ok=True)
    for name, data in seeds.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
    print(f"wrote {len(seeds)} seeds to {out}")



def dtrain(op, rid, payload=b""):
    return struct.pack("<IHHII", 0x53525444, 1, op, len(payload), rid) + payload


def s(b):
    b = b.encode() if isinstance(b, str) else b
    return struct.pack("<I", len(b)) + b


SET, GET, ADD, CAS, CHECK, DELETE, NUMKEYS, WAIT = range(1, 9)
seeds = {
    "dtrain_set_get": dtrain(SET, 1, s("k") + s("v")) + dtrain(GET, 2, s("k") + struct.pack("<I", 100)),
    "dtrain_add_cas": dtrain(ADD, 1, s("c") + struct.pack("<q", 5))
    + dtrain(CAS, 2, s("c") + s("5") + s("7"))
    + dtrain(CHECK, 3, struct.pack("<I", 2) + s("c") + s("x")),
    "dtrain_wait_delete": dtrain(SET, 1, s("a") + s(""))
    + dtrain(WAIT, 2, struct.pack("<I", 50) + struct.pack("<I", 2) + s("a") + s("b"))
    + dtrain(DELETE, 3, s("a"))
    + dtrain(NUMKEYS, 4),
    "dtrain_get_missing_parks": dtrain(GET, 1, s("never") + struct.pack("<I", 10)) + dtrain(NUMKEYS, 2),
    # SET_EPHEMERAL (11): keys deleted when the connection closes, one set again plainly
    "dtrain_ephemeral": dtrain(11, 1, s("e1") + s("x")) + dtrain(11, 2, s("e2") + s("y"))
    + dtrain(SET, 3, s("e2") + s("z")) + dtrain(DELETE, 4, s("e1")) + dtrain(11, 5, s("e1") + s("w")),
    # odd length: goes to the server with a job token (the proof is wrong: it is refused)
    "dtrain_auth_hello_odd": dtrain(9, 1, s(bytes(range(32)))) + dtrain(10, 2, s(bytes(32))) + b"\x00",
}


def c(q, *fields):
    b = bytes([q])
    for f in fields:
        b += f
    return b


def cs(x):
    x = x.encode() if isinstance(x, str) else x
    return struct.pack("<Q", len(x)) + x


def keys(*ks):
    return struct.pack("<Q", len(ks)) + b"".join(cs(k) for k in ks)


# v2 numbering (PyTorch 2.2+)
V = dict(VALIDATE=0, SET=1, CAS=2, GET=3, ADD=4, CHECK=5, WAIT=6, NUMKEYS=7, DELETE=8,
         APPEND=9, MGET=10, MSET=11, CANCEL=12, PING=13, LIST=17)
hello = c(V["VALIDATE"], struct.pack("<I", 0x3C85F7CE))
seeds["c10d_v2_basic"] = (hello + c(V["SET"], cs("/k"), cs("v")) + c(V["GET"], cs("/k"))
                          + c(V["ADD"], cs("/n"), struct.pack("<q", 3))
                          + c(V["CHECK"], keys("/k", "/z")) + c(V["NUMKEYS"]) + c(V["PING"], struct.pack("<I", 9)))
seeds["c10d_v2_multi"] = (hello + c(V["MSET"], struct.pack("<Q", 2), cs("/a"), cs("1"), cs("/b"), cs("2"))
                          + c(V["MGET"], keys("/a", "/b")) + c(V["APPEND"], cs("/a"), cs("x"))
                          + c(V["CAS"], cs("/a"), cs("1x"), cs("y")) + c(V["LIST"]) + c(V["DELETE"], cs("/b")))
seeds["c10d_v2_wait_cancel"] = hello + c(V["WAIT"], keys("/never")) + c(V["CANCEL"]) + c(V["WAIT"], keys("/k"))
# v1 numbering (PyTorch 1.13/2.0): SET 0, COMPARE_SET 1, GET 2, ADD 3, CHECK 4, WAIT 5, GETNUMKEYS 6, DELETE 8
seeds["c10d_v1_basic"] = (c(0, cs("/k"), cs("v")) + c(2, cs("/k")) + c(3, cs("/n"), struct.pack("<q", 1))
                          + c(4, keys("/k")) + c(5, keys("/k")) + c(6) + c(8, cs("/k")))

# odd length (the server with a job token): frames that must be refused from their header
# before the proof, a SET declaring 63 MiB and an AUTH_HELLO longer than one can be
seeds["dtrain_preauth_big_set_odd"] = struct.pack("<IHHII", 0x53525444, 1, SET, 63 << 20, 1) + b"k"
seeds["dtrain_preauth_long_hello_odd"] = dtrain(9, 1, s(bytes(40))) + b"\x00"

write_corpus("store_server", seeds)

# c10d_scan: one byte (bit 0: v1, else v2; the rest: piece size - 1), then the stream
c10d_scan_seeds = {
    "v2_basic_pieces_of_1": b"\x00" + seeds["c10d_v2_basic"],
    "v2_multi_pieces_of_8": b"\x0e" + seeds["c10d_v2_multi"],
    "v2_wait_cancel_pieces_of_3": b"\x04" + seeds["c10d_v2_wait_cancel"],
    "v1_basic_pieces_of_5": b"\x09" + seeds["c10d_v1_basic"],
    "v2_mset_big_value": b"\x20" + hello + c(V["MSET"], struct.pack("<Q", 1), cs("/big"), cs(bytes(5000))),
}
write_corpus("c10d_scan", c10d_scan_seeds)


# file_store_fuzz: whole store files ('S'|'D', u32 key length, u32 value length, key, value).


def rec(t, k, v):
    k = k.encode()
    return t + struct.pack("<II", len(k), len(v)) + k + v


files = {
    "two_sets": rec(b"S", "a", b"1") + rec(b"S", "n", b"5"),
    "set_delete": rec(b"S", "a", b"x") + rec(b"D", "a", b""),
    "users_counter": rec(b"S", "__dtrain_file_store_users", b"1") + rec(b"S", "n", b"41"),
    "torn_tail": rec(b"S", "a", b"1") + b"S\x05\x00\x00\x00",
}
write_corpus("file_store", files)


# launcher_options_fuzz: dtrain-run's argv after the program name, NUL-separated.
argvs = {
    "standalone": ["--standalone", "--nproc-per-node", "4", "./train", "--epochs", "3"],
    "static_two_nodes": ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                         "--master-port", "29500", "--nproc-per-node", "2", "./app"],
    "elastic_conf": ["--nnodes", "1:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:29400",
                     "--rdzv-conf", "join_timeout=30,close_timeout=5", "--max-restarts", "3", "./app"],
    "redirects_tee": ["--nproc-per-node", "auto", "--redirects", "0:1,1:2", "--tee", "3",
                      "--log-dir", "/tmp/x", "--local-ranks-filter", "0,1", "./app"],
    "equals_spelling": ["--nproc_per_node=2", "--monitor-interval=0.5", "--rdzv_id=job7", "--",
                        "./app", "-x"],
}
write_corpus("launcher_options", {n: b"\0".join(a.encode() for a in argv) for n, argv in argvs.items()})



# tensor_file_fuzz: whole tensor files (docs/tensor-file.md).
def tensor_file(metadata, tensors):
    """tensors: (name, dtype code, shape, raw bytes) in file order."""
    body = struct.pack("<I", len(metadata))
    for k, v in metadata:
        body += s(k) + s(v)
    body += struct.pack("<I", len(tensors))
    offset = 0
    for name, code, shape, raw in tensors:
        body += s(name) + struct.pack("<BB", code, len(shape)) + struct.pack(f"<{len(shape)}q", *shape)
        body += struct.pack("<QQI", offset, len(raw), zlib.crc32(raw))
        offset += len(raw)
    out = b"DTRNTENS" + struct.pack("<IIQ", 1, len(body), offset) + body
    out += struct.pack("<I", zlib.crc32(out))
    out += b"\0" * (-len(out) % 64)
    return out + b"".join(t[3] for t in tensors)


write_corpus("tensor_file", {
    "empty": tensor_file([], []),
    "two_tensors": tensor_file([("format", "x/1")],
                               [("w", 1, [2, 3], struct.pack("<6f", *range(6))),
                                ("n", 5, [3], struct.pack("<3q", 1, -2, 3))]),
    "scalar_and_empty": tensor_file([("k", b"\0\1")], [("s", 2, [], struct.pack("<d", 2.5)),
                                                       ("e", 10, [0, 4], b"")]),
})


# safetensors_fuzz: whole safetensors files (Hugging Face's format).
def safetensors_file(tensors, metadata=None, pad=True):
    """tensors: (name, dtype, shape, raw bytes) in data order."""
    header, offset = {}, 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    text = json.dumps(header).encode()
    if pad:
        text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(t[3] for t in tensors)


write_corpus("safetensors", {
    "empty": safetensors_file([]),
    "two_tensors": safetensors_file([("w", "F32", [2, 3], struct.pack("<6f", *range(6))),
                                     ("n", "I64", [3], struct.pack("<3q", 1, -2, 3))],
                                    {"format": "pt"}),
    "scalar_empty_bf16": safetensors_file([("s", "F64", [], struct.pack("<d", 2.5)), ("e", "BOOL", [0, 4], b""),
                                           ("h", "BF16", [2], b"\x80\x3f\x00\x40")], pad=False),
    "escapes": safetensors_file([("model.layers.0.\u00e9\"q\\", "U8", [2], b"ab")]),
})


# idx_reader_fuzz: one byte that picks the expectation, then the file.
def idx(magic, dims, raw):
    return struct.pack(f">I{len(dims)}I", magic, *dims) + raw


write_corpus("idx_reader", {
    "labels_gz": bytes([1]) + gzip.compress(idx(2049, [2], b"\x03\x07"), mtime=0),
    "images_2x3_gz": bytes([4]) + gzip.compress(idx(2051, [1, 2, 3], bytes(range(6))), mtime=0),
    "labels_raw": bytes([0]) + idx(2049, [1], b"\x09"),
})


# checkpoint_fuzz: checkpoints of the harness's model (fc: Linear(3, 2)) and
# its Adam, as examples/fashion_mnist/checkpoint.cpp saves them with one
# rank: a 4-byte length, metadata.dtt, then rank 0's data file.
def checkpoint(step):
    def f32(*shape):
        n = 1
        for d in shape:
            n *= d
        return struct.pack(f"<{n}f", *[0.25 if step else 0.0] * n)

    shapes = {"fc.weight": [2, 3], "fc.bias": [2]}
    tensors = {}
    for name, shape in shapes.items():
        tensors[f"model/param/{name}"] = (1, shape, f32(*shape))
        tensors[f"optimizer/optim/{name}/exp_avg"] = (1, shape, f32(*shape))
        tensors[f"optimizer/optim/{name}/exp_avg_sq"] = (1, shape, f32(*shape))
        tensors[f"optimizer/optim/{name}/step"] = (5, [], struct.pack("<q", step))
    # libtorch's CPU generator state: 5056 bytes; set_state wants the
    # mt19937 position `left` (int32 at byte 8) in 1..624 and `seeded`
    # (int32 at byte 12) set.
    tensors["rng"] = (9, [5056], bytes(8) + struct.pack("<ii", 1, 1) + bytes(5040))
    token = "0123456789abcdef"
    user = {"program": "dtrain-fashion-mnist/2", "model": "fc.weight:[2, 3];fc.bias:[2];",
            "epoch": "1", "samples_in_epoch": "64", "global_step": str(step), "world_size": "2",
            "adam/lr": "0.001", "adam/beta1": "0.9", "adam/beta2": "0.999", "adam/eps": "1e-08",
            "adam/weight_decay": "0", "adam/amsgrad": "0"}
    meta = [("format", "dtrain distributed checkpoint 1"), ("token", token), ("world_size", "1")]
    meta += [(f"replicated/{n}", "0") for n in tensors] + [(f"u/{k}", v) for k, v in user.items()]
    m = tensor_file(sorted(meta), [])
    data = tensor_file([], [(f"r/{n}", *tensors[n]) for n in sorted(tensors)])
    return struct.pack("<I", len(m)) + m + data


write_corpus("checkpoint", {"fresh": checkpoint(0), "stepped": checkpoint(3)})


# error_file_fuzz: workers' error files, as dtrain and torchrun write them.
write_corpus("error_file", {
    "dtrain": b'{"message": {"message": "std::runtime_error: boom", "extraInfo": {"py_callstack": '
              b'"std::runtime_error: boom", "timestamp": "1764000000", "dtrain_timestamp_ns": '
              b'"1764000000123456789"}}}\n',
    "torchrun": b'{"message": {"message": "ValueError: bad\\nTraceback (most recent call last):\\n  x", '
                b'"extraInfo": {"py_callstack": "...", "timestamp": 1764000000}}}',
    "short": b'{"message": "killed by the OOM killer"}',
})


# distributed_checkpoint_fuzz: a 4-byte length, metadata.dtt, then rank 0's
# data file, as dtrain::checkpoint::save writes them for a replicated
# float [2, 3] "param/w", a sharded 10-element "s" (flat pieces: offset,
# length) and a float [4, 3] "b" saved as boxes (row offset, rows).
def distributed_checkpoint(pieces, boxes=((0, 4),)):
    token = "0123456789abcdef"
    meta = [("format", "dtrain distributed checkpoint 1"), ("replicated/param/w", "0"),
            ("shape/b", "4,3"), ("sharded/b", "12"), ("sharded/s", "10"), ("token", token),
            ("u/epoch", "3"), ("world_size", "1")]
    m = tensor_file(meta, [])
    tensors = [("r/param/w", 1, [2, 3], struct.pack("<6f", *range(6)))]
    file_meta = []
    for row, rows in boxes:
        file_meta.append(("box/b", f"{row},0"))
        tensors.append(("s/b", 1, [rows, 3], struct.pack(f"<{3 * rows}f", *range(3 * rows))))
    for offset, n in pieces:
        file_meta.append(("offset/s", str(offset)))
        tensors.append(("s/s", 1, [n], struct.pack(f"<{n}f", *[0.5] * n)))
    return struct.pack("<I", len(m)) + m + tensor_file(sorted(file_meta), sorted(tensors))


write_corpus("distributed_checkpoint", {
    "whole": distributed_checkpoint([(0, 10)]),
    "short_piece": distributed_checkpoint([(4, 6)]),
    "short_box": distributed_checkpoint([(0, 10)], boxes=((1, 2),)),
})
