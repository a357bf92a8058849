"""netdist: asyncio TCP transport, collectives and parameter server for distributed training."""

from netdist.config import DistributedConfig, WireLimits
from netdist.transport import InProcessTransport, Transport
from netdist.types import ReduceOp

__version__ = "0.1.0"

__all__ = [
    "DistributedConfig",
    "WireLimits",
    "Transport",
    "InProcessTransport",
    "ReduceOp",
    "__version__",
]
