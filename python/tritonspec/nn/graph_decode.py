"""Greedy decode whose every step is one CUDA-graph replay: no Python, no guard check, no host sync per token.

Why not only ``generate(cache_implementation="static")``: its loop spends host time on every token that the GPU
then waits for. Dynamo checks the compiled step's guards (about 1.7 ms a token on a 48-layer MoE model), the
CUDA-graph tree launches its graph, and the stopping criteria read the tokens back. Here the whole step (the
forward on a ``StaticCache``, the argmax, end-of-sequence bookkeeping, feeding the token back) reads and writes
buffers of fixed addresses. It is compiled once (Inductor, ``fullgraph=True``), captured once per decoder, and
replayed; the host only asks whether every sequence has ended, every ``check_every`` tokens.

Greedy only: the same tokens as ``model.generate(..., do_sample=False)``, left-padded batches included.
Without CUDA (the CPU interpreter), the same loop runs its step without a graph.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn


_MAX_STOP_IDS = 8


def _cache_argument(model: nn.Module) -> str:
    # transformers 5.24 renamed the forward's past_key_values to cache (the class's: a kernelized forward may differ)
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


class GraphDecoder:
    """Greedy decoding of ``model`` (a transformers causal LM) for batches of ``batch_size`` sequences of at most
    ``max_cache_len`` tokens, prompt included.

    The decoder owns the ``StaticCache``, the step's buffers and, on CUDA, the captured graph; keep one per
    (model, batch size, length) and call :meth:`generate` as often as needed. It never changes the model.
    ``compile_backend``: the ``torch.compile`` backend of the step (None: eager; on CUDA a step is then captured
    only if it never synchronizes with the host, as our kernels and transformers' compiled paths do not).
    Modules with host work between steps (offloaded experts: their ``between_steps`` promotes the experts the
    steps read from host memory into GPU slots) get it after the prompt, every ``check_every`` tokens and at the
    end; the graph reads their tables, so it stays valid across their changes.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_cache_len: int,
        batch_size: int = 1,
        compile_backend: str | None = "inductor",
        check_every: int = 16,
    ):
        import transformers

        if not isinstance(model, transformers.PreTrainedModel) or not hasattr(model, "get_output_embeddings"):
            raise TypeError(f"model: expected a transformers causal LM, got {type(model).__name__}")
        for name, value in (("max_cache_len", max_cache_len), ("batch_size", batch_size), ("check_every", check_every)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        self.model, self.max_cache_len, self.batch_size = model, max_cache_len, batch_size
        self.check_every = check_every
        self.device = next(model.parameters()).device
        self.cache = transformers.StaticCache(config=model.config, max_cache_len=max_cache_len)
        self._cache_arg = _cache_argument(model)
        b, dev, long = batch_size, self.device, torch.long
        self._token = torch.zeros(b, 1, dtype=long, device=dev)  # the step's input, then its output
        self._position = torch.zeros(b, 1, dtype=long, device=dev)
        self._mask = torch.ones(b, max_cache_len, dtype=long, device=dev)  # the prompt's padding, then ones
        self._tokens = torch.zeros(b, max_cache_len, dtype=long, device=dev)  # generated tokens
        self._at = torch.zeros(1, dtype=long, device=dev)  # where the step writes in _tokens
        self._done = torch.zeros(b, dtype=torch.bool, device=dev)
        self._stop = torch.full((_MAX_STOP_IDS,), -1, dtype=long, device=dev)  # end-of-sequence ids; -1: none
        self._pad = torch.zeros((), dtype=long, device=dev)
        # Inductor: autotuned GEMMs (Triton's one-row kernels beat cuBLAS's at decode: H200, Qwen3-30B-A3B step
        # 4.7 -> 4.0 ms), as gpt-fast compiles its decode step
        options = (
            dict(max_autotune_gemm=True, coordinate_descent_tuning=True) if compile_backend == "inductor" else None
        )
        self._step = self._decode_step if compile_backend is None else torch.compile(
            self._decode_step, backend=compile_backend, fullgraph=True, options=options
        )  # fmt: skip
        self._graph = None
        self._warm = 0  # steps run outside a graph; captured after two (compiled, then one more to settle)
        self._model_state = None  # what the graph was captured against (see _captured_model)

    def _forward(self, ids, mask, position):
        kwargs = {self._cache_arg: self.cache}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=position, use_cache=True, logits_to_keep=1,
                         **kwargs)  # fmt: skip
        return out.logits[:, -1].argmax(-1)

    def _record(self, token: torch.Tensor) -> None:
        """Finished sequences keep emitting the pad token; a token in the stop set finishes its sequence."""
        token = torch.where(self._done, self._pad, token)
        self._done.logical_or_(torch.isin(token, self._stop))
        self._tokens.index_copy_(1, self._at, token[:, None])
        self._at.add_(1)
        self._token.copy_(token[:, None])

    def _decode_step(self) -> None:
        self._record(self._forward(self._token, self._mask, self._position))
        self._position.add_(1)

    def _captured_model(self) -> tuple:
        """What a captured graph depends on: every parameter's and buffer's storage, every module's forward
        (kernelize and revert rebind them), transformers' attention and experts switches, and the device state of
        modules that keep some outside their parameters (offloaded experts' slots and tables)."""
        model = self.model
        return (
            tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers())),
            tuple((m, m.__dict__.get("forward")) for m in model.modules()),
            getattr(model.config, "_attn_implementation", None),
            getattr(model.config, "_experts_implementation", None),
            tuple(m.graph_key() for m in self._hosted()),
        )

    def _hosted(self) -> list:
        """Modules with host work between graph-captured steps (offloaded experts: ``between_steps``)."""
        return [m for m in self.model.modules() if callable(getattr(m, "between_steps", None))]

    def _between_steps(self) -> None:
        for m in self._hosted():
            m.between_steps()

    def _run_step(self) -> None:
        if self._graph is not None:
            self._graph.replay()
            return
        if self.device.type != "cuda" or self._warm < 2:
            self._warm += 1
            self._step()
            return
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step()  # recorded only: run by the replay below
        self._graph = graph
        graph.replay()

    def _check(self, input_ids, attention_mask, max_new_tokens):
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
            raise ValueError(f"input_ids: expected a 2-D int64 tensor, got {getattr(input_ids, 'shape', input_ids)!r}")
        if input_ids.shape[0] != self.batch_size or input_ids.device != self.device:
            raise ValueError(
                f"input_ids: expected batch {self.batch_size} on {self.device} (the decoder's), got "
                f"batch {input_ids.shape[0]} on {input_ids.device}"
            )
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected a positive int, got {max_new_tokens!r}")
        if input_ids.shape[1] + max_new_tokens > self.max_cache_len:
            raise ValueError(
                f"max_new_tokens: the prompt's {input_ids.shape[1]} tokens plus {max_new_tokens} new exceed the "
                f"decoder's max_cache_len={self.max_cache_len}"
            )
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask: expected the shape of input_ids {tuple(input_ids.shape)}")
            if ((attention_mask != 0) & (attention_mask != 1)).any() or (attention_mask[:, -1] != 1).any():
                raise ValueError("attention_mask: expected 0 and 1 only, with the padding on the left")

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
    ) -> torch.Tensor:
        """The prompt followed by up to ``max_new_tokens`` greedy tokens, as ``model.generate(input_ids,
        attention_mask=..., max_new_tokens=..., do_sample=False)`` returns them on a static cache.

        ``eos_token_id`` defaults to the model's generation config (``[]``: never stop early); sequences that
        ended are padded with ``pad_token_id`` (default: the generation config's, else the first stop id), and
        decoding stops, within ``check_every`` tokens, once every sequence has ended.
        """
        self._check(input_ids, attention_mask, max_new_tokens)
        config = self.model.generation_config
        stop = config.eos_token_id if eos_token_id is None else eos_token_id
        stop = [] if stop is None else [stop] if isinstance(stop, int) else list(stop)
        if len(stop) > _MAX_STOP_IDS or not all(isinstance(t, int) and t >= 0 for t in stop):
            raise ValueError(f"eos_token_id: expected at most {_MAX_STOP_IDS} token ids >= 0, got {stop!r}")
        pad = pad_token_id if pad_token_id is not None else config.pad_token_id
        pad = pad if pad is not None else (stop[0] if stop else 0)
        prompt = input_ids.shape[1]

        self.cache.reset()
        self._mask.fill_(1)
        if attention_mask is not None:
            self._mask[:, :prompt].copy_(attention_mask)
        mask = self._mask[:, :prompt]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: numbered as generate numbers them
        self._stop.fill_(-1)
        self._stop[: len(stop)] = torch.tensor(stop, dtype=torch.long)
        self._pad.fill_(pad)
        self._done.zero_()
        self._at.zero_()
        self._position.copy_(positions[:, -1:] + 1)
        self._record(self._forward(input_ids, self._mask if attention_mask is not None else None, positions))
        state = self._captured_model()  # after the prompt's forward, which places offloaded experts on the device
        if state != self._model_state:  # the model changed since the capture: the graph would run the old one
            self._graph, self._warm, self._model_state = None, 0, state
        self._between_steps()
        for made in range(1, max_new_tokens):
            if made % self.check_every == 0:
                self._between_steps()
                if stop and bool(self._done.all()):
                    break
            self._run_step()
        self._between_steps()
        made = int(self._at.item())
        tokens = self._tokens[:, :made]
        if stop:  # generate stops at the step every sequence has ended
            ended = torch.isin(tokens, self._stop)
            last = torch.where(ended.any(1), ended.int().argmax(1), made - 1)
            tokens = tokens[:, : int(last.max()) + 1]
        return torch.cat([input_ids, tokens], dim=1)
