"""GPT-NeoX (Pythia): ``x + attn(norm1(x)) + mlp(norm2(x))`` where ``use_parallel_residual``, else Llama's sequential pre-norm block."""

from ...blocks import Attention, Mlp
from ...blocks.parallel import ConfigParallelLayer
from ...families import FamilySpec
from ...families.renames import GPT_NEOX

SPEC = FamilySpec(rename=GPT_NEOX, envoys={"layers.*": ConfigParallelLayer, "self_attn": Attention, "mlp": Mlp})
