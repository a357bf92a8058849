"""``NetdistTrainingArguments``: Hugging Face's ``TrainingArguments`` with ``ddp_backend="netdist"``.

Opt-in (importing this module imports transformers). The stock ``TrainingArguments``
cannot take ``ddp_backend="netdist"``: ``HfArgumentParser`` lists a fixed set of choices
(``--ddp_backend netdist`` is an argparse error), and accelerate, which sets up the
devices, maps every CPU backend to Gloo or MPI and refuses any other name (``ValueError:
Your assigned backend netdist is not available, please use gloo``). What accelerate does
accept is a process group that already exists: with ``use_cpu=True`` it keeps it and the
Trainer wraps the model in DDP over it. This subclass takes that documented route for you::

    from transformers import HfArgumentParser
    from netdist.torch.huggingface import NetdistTrainingArguments

    (args,) = HfArgumentParser(NetdistTrainingArguments).parse_args_into_dataclasses()
    # python train.py --ddp_backend netdist ...   (launched by torchrun, netdist launch...)

With ``ddp_backend="netdist"`` it initialises torch's default process group on netdist
from the launcher's ``env://`` variables (timeout ``ddp_timeout``) unless one exists,
implies ``use_cpu=True`` (netdist carries CPU tensors), hands accelerate no backend name,
and afterwards checks with :func:`~netdist.torch.data_parallel_check.check_data_parallel`
that the Trainer will train data-parallel over netdist, raising ``ConfigError`` if not.
Any other ``ddp_backend`` behaves exactly as in ``TrainingArguments``.

It subclasses a public dataclass and touches only public fields (``ddp_backend``,
``use_cpu``, ``ddp_timeout``), never transformers' or accelerate's internals, so a new
release that keeps those fields keeps it working; the ``ddp_backend`` choices are the
parent field's plus ``"netdist"``, read when this module is imported.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist
from transformers import TrainingArguments

from netdist.torch.backend import BACKEND_NAME
from netdist.torch.data_parallel_check import check_data_parallel

__all__ = ["NetdistTrainingArguments", "check_data_parallel"]

_PARENT_FIELD = {f.name: f for f in dataclasses.fields(TrainingArguments)}["ddp_backend"]
_METADATA = dict(_PARENT_FIELD.metadata)
if "choices" in _METADATA:  # a parent without a fixed list accepts the name already
    _METADATA["choices"] = [*_METADATA["choices"], BACKEND_NAME]
_METADATA["help"] = (f"{_METADATA.get('help', 'The backend to use for distributed training.')} "
                     f"Or '{BACKEND_NAME}': CPU training over netdist's torch.distributed "
                     f"backend.")


@dataclass
class NetdistTrainingArguments(TrainingArguments):
    """``TrainingArguments`` whose ``ddp_backend`` may be ``"netdist"`` (see the module)."""

    ddp_backend: str | None = field(default=None, metadata=_METADATA)

    def __post_init__(self) -> None:
        if self.ddp_backend != BACKEND_NAME:
            super().__post_init__()
            return
        if not dist.is_initialized():
            dist.init_process_group(BACKEND_NAME, timeout=timedelta(seconds=self.ddp_timeout))
        self.use_cpu = True
        # accelerate refuses the name, but keeps the group that exists
        self.ddp_backend = None
        try:
            super().__post_init__()
        finally:
            self.ddp_backend = BACKEND_NAME
        check_data_parallel(self)
