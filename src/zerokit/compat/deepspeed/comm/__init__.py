"""deepspeed.comm: the process group and collectives (torch.distributed underneath)."""
from zerokit.compat.deepspeed.comm.comm import *  # noqa: F401,F403
from zerokit.compat.deepspeed.comm.comm import __all__  # noqa: F401
