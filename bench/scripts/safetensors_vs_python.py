"""dtrain's safetensors files against Hugging Face's own library
(python3-safetensors) and against the published format read here by hand.

  python3 safetensors_vs_python.py check DIR          DIR/model.safetensors: load_file and the
                                                      format by hand agree bitwise
  python3 safetensors_vs_python.py rewrite DIR OUT    each tensor of DIR changed (x * 2 + 1 for
                                                      floats, + 1 for integers), saved by save_file
  python3 safetensors_vs_python.py same A B           A's and B's tensors equal bitwise
  python3 safetensors_vs_python.py experts DIR L E    each of L layers' E experts under Hugging Face's
                                                      per-expert names, and no stacked [E, ...] tensor
"""
import json
import os
import struct
import sys

import torch
from safetensors.torch import load_file, save_file

TYPES = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16, "BF16": torch.bfloat16,
         "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
         "BOOL": torch.bool}


def by_hand(path):
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = bytearray(data[8 + n + begin:8 + n + end])
        t = torch.frombuffer(raw, dtype=TYPES[info["dtype"]]) if raw else torch.empty(0, dtype=TYPES[info["dtype"]])
        out[name] = t.reshape(info["shape"])
    return out


def same(a, b, what):
    if sorted(a) != sorted(b):
        sys.exit(f"{what}: different tensor names: {sorted(set(a) ^ set(b))[:5]}")
    for name in a:
        x, y = a[name], b[name]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(torch.uint8) if x.dtype == torch.bool
                                                                       else x, y.view(torch.uint8) if y.dtype == torch.bool else y):
            sys.exit(f"{what}: tensor {name} differs ({x.dtype} {list(x.shape)} against {y.dtype} {list(y.shape)})")
    return len(a)


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "check":
        path = os.path.join(sys.argv[2], "model.safetensors")
        n = same(load_file(path), by_hand(path), path)
        print(f"  {path}: {n} tensors; safetensors.torch.load_file and the format read by hand agree bitwise")
    elif cmd == "experts":
        tensors = load_file(os.path.join(sys.argv[2], "model.safetensors"))
        layers, experts = int(sys.argv[3]), int(sys.argv[4])
        for layer in range(layers):
            for e in range(experts):
                for kind in ("gate_proj", "up_proj", "down_proj"):
                    name = f"layers.{layer}.moe.experts.{e}.{kind}.weight"
                    if name not in tensors or tensors[name].dim() != 2:
                        sys.exit(f"no two-dimensional tensor {name} in {sys.argv[2]}")
        stacked = [k for k in tensors if k.endswith(("experts.w1", "experts.w2", "experts.w3"))]
        if stacked:
            sys.exit(f"stacked expert tensors in {sys.argv[2]}: {stacked[:3]}")
        print(f"  {layers} layers x {experts} experts x 3 under Hugging Face's per-expert names")
    elif cmd == "rewrite":
        tensors = load_file(os.path.join(sys.argv[2], "model.safetensors"))
        changed = {k: (v * 2 + 1 if v.is_floating_point() else v + 1).contiguous() for k, v in tensors.items()}
        os.makedirs(sys.argv[3], exist_ok=True)
        save_file(changed, os.path.join(sys.argv[3], "model.safetensors"), metadata={"format": "pt"})
        print(f"  {len(changed)} tensors changed and written by safetensors.torch.save_file")
    else:
        a = load_file(os.path.join(sys.argv[2], "model.safetensors"))
        b = load_file(os.path.join(sys.argv[3], "model.safetensors"))
        print(f"  {same(a, b, 'the round trip')} tensors imported by dtrain and exported again: bitwise "
              f"what save_file wrote")
