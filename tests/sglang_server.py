"""SGLang 0.5.23's control plane in this process, for the contract tests: every request our client sends
is parsed the way its http_server parses it (the route's io_struct class through pydantic; ``/generate``
through ``GenerateReqInput.normalize_batch_and_arguments``) and handed to SGLang's real
``SchedulerWeightUpdaterManager`` (weight-update sessions, memory tags) and ``WeightChecker``
(``/weights_checker`` checksums). What needs a GPU is stubbed (see tests/sglang_imports.py): the model
runner's receive/load, which here copy tensors into a CPU module that holds SGLang's parameter layout
(q/k/v fused into ``qkv_proj``, gate/up into ``gate_up_proj``, block-FP8 linears with SGLang's own
``Fp8LinearMethod`` parsed from the checkpoint's ``quantization_config``), and the memory saver.

A request SGLang answers with an error raises ``ServerError`` with the HTTP status its route uses; a
call that would kill SGLang's scheduler process (an exception inside the manager) raises
``SchedulerDied``.
"""
from __future__ import annotations

import json
import queue
import types
from typing import Any

import torch

from megatron_jetrl.rollout.sglang import ServerError
from tests.sglang_imports import sglang_srt

FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class SchedulerDied(AssertionError):
    """SGLang's scheduler process would have died on this call."""


def setup_sglang_runtime(server_argv: list[str]) -> None:
    """Publish ``server_argv`` (parsed by SGLang's ServerArgs) and a one-rank TP group over the default
    gloo group, as the launcher does for a TP=1 scheduler."""
    import argparse

    import torch.distributed as dist

    sglang_srt()
    from sglang.srt.runtime_context import get_context, get_parallel
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    get_context().set_server_args(ServerArgs.from_cli_args(parser.parse_args(server_argv)))
    get_parallel().override_permanently(tp_group=types.SimpleNamespace(cpu_group=dist.group.WORLD), tp_rank=0,
                                        tp_size=1, dp_rank=0, attn_dp_size=1, pp_rank=0, pp_size=1)


class _Linear(torch.nn.Module):
    def __init__(self, quant_method, weight: torch.Tensor, scale: torch.Tensor | None):
        super().__init__()
        self.quant_method = quant_method
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        if scale is not None:
            self.weight_scale_inv = torch.nn.Parameter(scale, requires_grad=False)


class SGLangModel(torch.nn.Module):
    """A CPU module with SGLang's parameter names and shapes for an HF checkpoint's tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor], quantization_config: dict | None):
        super().__init__()
        from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod

        method = Fp8LinearMethod(Fp8Config.from_config(quantization_config)) if quantization_config else None
        self.fused: dict[str, tuple[str, int, int]] = {}  # HF name -> (SGLang module path, row offset, rows)
        groups: dict[str, list[tuple[int, str]]] = {}
        for name in tensors:
            base, _, leaf = name.removesuffix(".weight").rpartition(".") if name.endswith(".weight") else (name, "", "")
            if leaf in FUSED:
                groups.setdefault(f"{base}.{FUSED[leaf][0]}", []).append((FUSED[leaf][1], name))
            elif leaf in ("o_proj", "down_proj"):
                groups[f"{base}.{leaf}"] = [(0, name)]
        self.raw: dict[str, torch.nn.Parameter] = {}
        linear_names = {n for parts in groups.values() for _, n in parts}
        for path, parts in groups.items():
            parts = [n for _, n in sorted(parts)]
            w = torch.cat([tensors[n] for n in parts])
            fp8 = w.dtype == torch.float8_e4m3fn
            s = torch.cat([tensors[n + "_scale_inv"] for n in parts]) if fp8 else None
            row = 0
            for n in parts:
                self.fused[n] = (path, row, tensors[n].shape[0])
                row += tensors[n].shape[0]
            self._module(path).add_module(path.rsplit(".", 1)[1], _Linear(method if fp8 else None, w, s))
        for name, t in tensors.items():
            if name in linear_names or name.removesuffix("_scale_inv") in linear_names:
                continue
            mod, leaf = name.rsplit(".", 1)
            self._module(mod + ".x").register_parameter(leaf, torch.nn.Parameter(t.clone(), requires_grad=False))

    def _module(self, path: str) -> torch.nn.Module:
        m = self
        for part in path.split(".")[:-1]:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        return m

    def load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """SGLang's load_weights for this layout: HF q/k/v and gate/up rows into their fused slot."""
        params = dict(self.named_parameters())
        for name, t in named:
            w_name = name.removesuffix("_scale_inv")
            if w_name in self.fused:
                path, row, rows = self.fused[w_name]
                if name.endswith("_scale_inv"):
                    dst, block = params[path + ".weight_scale_inv"], params[path + ".weight"].shape[0] // \
                        params[path + ".weight_scale_inv"].shape[0]
                    dst.data[row // block:(row + rows) // block] = t
                else:
                    params[path + ".weight"].data[row:row + rows] = t
            else:
                params[name].data.copy_(t)


class SGLangServer:
    """One TP=1 SGLang server's control plane around the real manager; ``handle(path, body)`` answers
    what its HTTP route answers."""

    def __init__(self, tensors: dict[str, torch.Tensor], quantization_config: dict | None):
        sglang_srt()
        import sglang
        from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
        from sglang.srt.utils.weight_checker import WeightChecker

        self.version = sglang.__version__
        self.model = SGLangModel(tensors, quantization_config)
        self.weight_version = "0"
        self.calls: list = []            # (what, detail) in order: the test's record of the server's life
        self.wire: queue.Queue = queue.Queue()  # flattened buckets the trainer broadcasts
        self.generated: list[dict] = []
        checker = WeightChecker(get_model=lambda: self.model)
        server = self

        class Updater:  # the model runner's WeightUpdater, without CUDA
            def begin_weight_update(self):
                server.calls.append(("runner.begin", None))

            def end_weight_update(self, *, run_post_load):
                server.calls.append(("runner.end", run_post_load))

            def receive_weights_from_distributed(self, *, names, dtypes, shapes, group_name, load_format=None):
                from megatron_jetrl.sync.sglang_bucket import sglang_bucket_class

                assert load_format == "flattened_bucket", load_format
                flat = server.wire.get(timeout=30)
                bucket = sglang_bucket_class().empty(names, [getattr(torch, d) for d in dtypes], shapes, flat.device)
                bucket.get_flattened_tensor().copy_(flat)
                server.calls.append(("runner.receive", list(names)))
                return bucket.reconstruct_tensors()

            def load_weights_from_distributed(self, named):
                server.model.load(named)
                return True, "Succeeded to update parameter online."

            def update_weights_from_disk(self, model_path, load_format, recapture_cuda_graph=False):
                from megatron_jetrl.models.hf_io import HFCheckpoint

                ckpt = HFCheckpoint(model_path)
                server.model.load([(n, ckpt.raw(n)) for n in ckpt.keys()])
                server.calls.append(("runner.load_disk", model_path))
                return True, "Succeeded to update model weights."

        runner = types.SimpleNamespace(
            weight_updater=Updater(),
            check_weights=lambda action, allow_quant_error, skip_tensor_list, role:
                checker.handle(action, allow_quant_error, skip_tensor_list, role=role))
        worker = types.SimpleNamespace(
            weight_update_runners=lambda: [("target", runner)],
            model_runner=types.SimpleNamespace(weight_updater=runner.weight_updater, model=self.model),
            init_weights_update_group=lambda req: (True, "Succeeded to initialize custom process group."),
            destroy_weights_update_group=lambda req: (True, "Succeeded to destroy custom process group."))
        saver = types.SimpleNamespace(pause=lambda tag: self.calls.append(("pause", tag)),
                                      resume=lambda tag: self.calls.append(("resume", tag)))
        scheduler = types.SimpleNamespace(_engine_paused=False, disaggregation_mode=None,
                                          record_weight_version_change=self._record_version)
        self.manager = SchedulerWeightUpdaterManager(
            tp_worker=worker, draft_worker=None, memory_saver_adapter=saver, flush_cache=lambda **kw: True,
            is_fully_idle=lambda **kw: True, scheduler=scheduler)

    def _record_version(self, new_version):
        if new_version is not None:
            self.weight_version = str(new_version)

    def _parse(self, cls_name: str, body: Any):
        """FastAPI's parsing of a route's body into its io_struct class (pydantic over the class)."""
        import pydantic
        from sglang.srt.managers import io_struct

        return pydantic.TypeAdapter(getattr(io_struct, cls_name)).validate_json(json.dumps(body))

    def _ok(self, path: str, out) -> dict:
        if not out.success:
            raise ServerError(f"sglang{path}: HTTP 400: {out.message}")
        return {"success": True, "message": out.message}

    def handle(self, path: str, body: Any):
        m = self.manager
        try:
            if path == "/server_info":
                return {"version": self.version, "frontend": "python"}
            if path == "/model_info":
                return {"weight_version": self.weight_version, "model_path": "m"}
            if path == "/health_generate":
                return ""
            if path == "/generate":
                return self._generate(body)
            sessions = {"/begin_weight_update": ("BeginWeightUpdateReqInput", m.begin_weight_update),
                        "/end_weight_update": ("EndWeightUpdateReqInput", m.end_weight_update),
                        "/update_weights_from_distributed": ("UpdateWeightsFromDistributedReqInput",
                                                             m.update_weights_from_distributed),
                        "/update_weights_from_disk": ("UpdateWeightFromDiskReqInput", m.update_weights_from_disk),
                        "/init_weights_update_group": ("InitWeightsUpdateGroupReqInput", m.init_weights_update_group),
                        "/destroy_weights_update_group": ("DestroyWeightsUpdateGroupReqInput",
                                                          m.destroy_weights_update_group)}
            if path in sessions:
                cls, fn = sessions[path]
                self.calls.append((path, None))
                return self._ok(path, fn(self._parse(cls, body)))
            if path in ("/release_memory_occupation", "/resume_memory_occupation"):
                cls = "ReleaseMemoryOccupationReqInput" if "release" in path else "ResumeMemoryOccupationReqInput"
                req = self._parse(cls, body)
                self.calls.append((path, req.tags))
                fn = m.release_memory_occupation if "release" in path else m.resume_memory_occupation
                try:
                    fn(req)
                except KeyError as e:  # raised inside the scheduler's event loop: the process dies
                    raise SchedulerDied(f"{path} {req.tags}: KeyError {e} in SGLang's scheduler") from None
                return None
            if path == "/weights_checker":
                out = m.check_weights(self._parse("CheckWeightsReqInput", body))
                if not out.success:
                    raise ServerError(f"sglang{path}: HTTP 400: {out.message}")
                import msgspec

                return {"success": True, "message": out.message, "ranks": msgspec.to_builtins(out.payload)}
        except (ServerError, SchedulerDied):
            raise
        except Exception as e:  # noqa: BLE001 - the route's _create_error_response
            raise ServerError(f"sglang{path}: HTTP 400: {type(e).__name__}: {e}") from None
        raise ServerError(f"sglang{path}: HTTP 404: Not Found")

    def _generate(self, body: dict):
        from sglang.srt.managers.io_struct import GenerateReqInput
        from sglang.srt.sampling.sampling_params import SamplingParams

        if self.manager.offload_tags:
            raise SchedulerDied(f"/generate with memory released ({sorted(self.manager.offload_tags)}): "
                                "SGLang would run on freed KV cache / weights / CUDA graphs")
        req = GenerateReqInput(**body)
        req.normalize_batch_and_arguments()
        rows = req.sampling_params if isinstance(req.sampling_params, list) else [req.sampling_params]
        ids = req.input_ids if isinstance(req.input_ids[0], list) else [req.input_ids]
        rids = req.rid if isinstance(req.rid, list) else [req.rid]
        out = []
        for prompt, sp, rid in zip(ids, rows, rids):
            params = SamplingParams(**sp)
            params.verify(1000)
            self.generated.append({"rid": rid, "seed": params.sampling_seed, "prompt": prompt,
                                   "weight_version": self.weight_version})
            tokens = [(sum(prompt) + i) % 50 + 1 for i in range(params.max_new_tokens)]
            out.append({"text": "", "output_ids": tokens, "meta_info": {
                "id": rid, "finish_reason": {"type": "length", "length": len(tokens)},
                "weight_version": self.weight_version,
                "output_token_logprobs": [[-1.0, t, None] for t in tokens]}})
        return out
