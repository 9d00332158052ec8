"""What dualvp's ``torch.library`` ops share: the ``dualvp`` library fragment, their tags, the dispatch keys
of the eager shortcut, a process group from its name, and the schema-fit test of the logits options.

The logits op (:mod:`dualvp_torch.library`), its extended form (:mod:`dualvp_torch.extended`) and the fused
LM-head op (:mod:`dualvp_torch.linear`) are defined on one fragment and registered the same way; this leaf
module is where those pieces live, so that none of the three imports another for them.
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from . import collectives

__all__ = ["LIB", "PT2", "AFTER_AUTOGRAD", "DIRECT", "group_of", "eligible", "register_kernels"]

#: The ``dualvp`` namespace's fragment every dualvp op is defined on.
LIB = torch.library.Library("dualvp", "FRAGMENT")
#: The ops' tags: each is pt2-compliant (a caller's ``torch.compile`` keeps it as one node).
PT2 = (torch.Tag.pt2_compliant_tag,)
#: The keys below autograd of an op's autograd kernel, and the backends whose kernel it may call directly
#: (no tracing mode, fake or functional tensor below: the eager shortcut that skips a dispatcher trip).
AFTER_AUTOGRAD = torch._C._after_autograd_keyset
DIRECT = frozenset({torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA})


def group_of(name: str):
    """The process group an op received by name (its schema takes ``str group_name``; ``""`` is none)."""
    return torch.distributed.distributed_c10d._resolve_process_group(name) if name else None


def eligible(logits: object, target: object, *, group: object = None, keep_mask: object = None,
             temperature: object = 1.0, with_entropy: object = True, entropy_grad: object = True,
             ignore_index: object = -100, validate: object = True, inplace_grad: object = False,
             impl: object = None, keep_ids: object = None) -> bool:
    """Whether a logits call's arguments fit the custom op's schema as they are (plain tensors, options of their
    documented Python types): then the op is called as is; else the checks convert them first, and in a
    caller's ``torch.compile`` the call is one graph break."""
    # (written out, no generator: this runs on every call)
    return (
        type(logits) is Tensor and type(target) is Tensor and (keep_mask is None or type(keep_mask) is Tensor)
        and (keep_ids is None or type(keep_ids) is Tensor)
        and type(with_entropy) is bool and type(entropy_grad) is bool and type(validate) is bool
        and type(inplace_grad) is bool
        and (type(temperature) is float or isinstance(temperature, numbers.Real) and not isinstance(temperature, bool))
        and (type(ignore_index) is int or isinstance(ignore_index, int) and not isinstance(ignore_index, bool))
        and (impl is None or isinstance(impl, str))
        and (group is None or collectives.is_process_group(group))
    )


def register_kernels(kernels, inplace: str = "") -> None:
    """Register each ``(name, kernel, fake)`` of ``kernels`` on :data:`LIB`: the kernel for every device (the
    engine is the call's), the fake kernel for tracing. ``inplace`` names the op among them that mutates its
    first argument (a gradient written into the logits): its ``ADInplaceOrView`` kernel moves that tensor's
    version counter (another autograd node that saved it then raises torch's "modified by an inplace
    operation" error) and runs the kernel below."""
    for name, kernel, fake in kernels:
        LIB.impl(name, kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"dualvp::{name}", fake, lib=LIB)
    if inplace:
        op = getattr(torch.ops.dualvp, inplace).default

        def bump_version(keyset, mutated, *rest, **kw):
            torch.autograd.graph.increment_version(mutated)
            return op.redispatch(keyset & torch._C._after_ADInplaceOrView_keyset, mutated, *rest, **kw)

        LIB.impl(inplace, bump_version, "ADInplaceOrView", with_keyset=True)


def no_output(*args, **kwargs) -> None:
    """The fake kernel of an op that returns nothing (the in-place backward)."""
    return None

