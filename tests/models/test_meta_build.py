"""Models built on the meta device skip their initialisation (models/meta_build.py): the start-up
check's dry run imports none of torch's compiler stack, modules built on a real device inside
the block keep theirs, and a materialised model's computed tables equal a directly built one's."""

from __future__ import annotations

import subprocess
import sys

import torch
from torch import nn

from ninfer.bench.checkpoint import shape_config
from ninfer.models.loader import build_model
from ninfer.models.meta_build import meta_build

# A fresh interpreter: whether torch._dynamo was imported is process-wide.
_DRY_RUN = """
import sys
import torch
from ninfer.bench.checkpoint import shape_config
from ninfer.bench.shapes import SHAPES
from ninfer.models.loader import build_model
for shape in SHAPES:  # the dense 27B, the 35B-A3B MoE, the tiny test shape
    _, config = shape_config(shape)
    model = build_model(config, torch.bfloat16, "meta")
    assert all(p.is_meta for p in model.parameters())
print("torch._dynamo" in sys.modules, "sympy" in sys.modules)
"""


def test_meta_builds_of_the_benchmark_shapes_import_no_compiler_stack():
    done = subprocess.run([sys.executable, "-c", _DRY_RUN], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]


def test_modules_on_a_real_device_keep_their_initialisation():
    with meta_build():
        on_meta = nn.Embedding(64, 8)
        torch.manual_seed(0)
        on_cpu = nn.Embedding(64, 8, device="cpu")
        linear = nn.Linear(8, 8, device="cpu")
    torch.manual_seed(0)
    expected = nn.Embedding(64, 8)
    assert on_meta.weight.is_meta
    assert torch.equal(on_cpu.weight, expected.weight)
    assert linear.weight.abs().sum() > 0


def test_a_materialised_models_rotary_table_equals_a_directly_built_ones():
    _, config = shape_config("27b")
    config = config.replace(num_hidden_layers=1, layer_types=config.layer_types[:1], vocab_size=256)
    model = build_model(config, torch.float32, "cpu")
    direct = type(model)(config)
    tables = [m.inv_freq for m in model.modules() if hasattr(m, "inv_freq")]
    direct_tables = [m.inv_freq for m in direct.modules() if hasattr(m, "inv_freq")]
    assert tables and len(tables) == len(direct_tables)
    for table, direct_table in zip(tables, direct_tables):
        assert torch.equal(table, direct_table)
