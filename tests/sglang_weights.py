"""Run as a script (a process of its own: SGLang's distributed state): load a checkpoint with
SGLang's own model loader on the CPU and save, with torch.save, the tensors the seam would share
with the verifier (seam.export.select). argv: checkpoint folder, output file."""

import socket
import sys

from mg_server.launch import compat

compat.install("cpu")

import torch  # noqa: E402
from sglang.srt.configs.device_config import DeviceConfig  # noqa: E402
from sglang.srt.configs.load_config import LoadConfig  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel  # noqa: E402
from sglang.srt.layers.dp_attention import init_dp_gathered_buffer, initialize_dp_attention  # noqa: E402
from sglang.srt.model_loader.loader import get_model_loader  # noqa: E402
from sglang.srt.runtime_context import SpawnRanks, publish  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from mg_server.seam.export import select  # noqa: E402

path, out = sys.argv[1], sys.argv[2]
args = ServerArgs(model_path=path, device="cpu", tp_size=1, dtype="bfloat16")
publish(args, role="weight_cache_daemon", ranks=SpawnRanks(world_rank=0, gpu_id=0))
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=0,
                             backend="gloo")
initialize_model_parallel()
config = ModelConfig(model_path=path, dtype="bfloat16")
initialize_dp_attention(args)
try:
    init_dp_gathered_buffer(config)
except Exception:  # noqa: BLE001 - (not needed on a CPU)
    pass
model = get_model_loader(load_config=LoadConfig(load_format="auto"), model_config=config).load_model(
    model_config=config, device_config=DeviceConfig("cpu", 0))
torch.save({n: t.clone() for n, t in select(model).items()}, out)
