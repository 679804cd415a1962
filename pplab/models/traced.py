"""Any module as pipeline stages, cut at module names by torch's own tracer.

`TracedModel(make, split_at=["layers.4"])` describes a language model of your own to
pplab: `make()` builds it (token ids [batch, seq] in, logits [batch, seq, vocab] out),
and torch's tracer (`torch.distributed.pipelining.pipeline` with `SplitPoint.BEGINNING`
at each name) cuts its forward into `len(split_at) + 1` stages. Each stage is the
traced piece of the forward, holding the model's own submodules at their own paths, so
parameter names, checkpoints and parity are the model's.

The tracer bakes the example's shapes into the graph: a traced model runs microbatches
of `example_shape` (microbatch size, sequence length) only, and says so otherwise.
Between stages it must pass one activation [batch, seq, hidden], as pplab's runtimes
send one tensor per boundary; a cut that passes more is refused with what it passes.

Weights: `make()` is the only place that knows a module's initial values and buffers,
so each rank calls it (under `torch.manual_seed(seed)`, as the one-device reference
does), traces the whole, and keeps only its stages: the whole model is on every rank
while it builds. A factory that loads weights from a file loads them the same way.
For Hugging Face decoders `pplab.models.hf.HFModel` builds only a rank's own stages.

Floor 1, beside `pplab.models.llama` and `pplab.models.hf`: it answers the questions every model
description answers (see `pplab.models.partition`).
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from pplab.models.llama import check_token_ids

__all__ = ["TracedModel"]


@dataclass(frozen=True, eq=False)
class TracedModel:
    """A module of your own, cut into stages at `split_at` by torch's tracer.

    make           builds the whole model: a class or a function with no arguments, defined at
                   the top level of a module the ranks can import (it travels to them by name)
    split_at       the module names each new stage begins at, in forward order ("layers.4")
    example_shape  (microbatch size, sequence length) of the microbatches it will run
    """

    make: Callable[[], nn.Module]
    split_at: tuple[str, ...]
    example_shape: tuple[int, int] = (2, 16)
    _traced: dict = field(default_factory=dict, repr=False, compare=False)  # the client's trace

    tied = ()  # a weight two stages share is not found by the tracer: give each stage its own
    sum_tied_gradients = True

    def __post_init__(self):
        split_at = (self.split_at,) if isinstance(self.split_at, str) else self.split_at  # one name
        object.__setattr__(self, "split_at", tuple(split_at))
        object.__setattr__(self, "example_shape", tuple(self.example_shape))
        self.check()

    def __getstate__(self):
        return {key: value for key, value in self.__dict__.items() if key != "_traced"} | {"_traced": {}}

    def __setstate__(self, state):
        self.__dict__.update(state)

    # --- checked on the client, before any rank builds ----------------------------------------

    def check(self) -> None:
        """Refuse what cannot be pipelined: names that are not modules, an untraceable forward, a
        boundary that is not one activation, an output that is not logits."""
        if not callable(self.make):
            raise TypeError(f"make={self.make!r} is not callable: give the model's class, or a function "
                            f"with no arguments that returns the model")
        if getattr(self.make, "__module__", None) == "__main__":
            raise ValueError(f"make={getattr(self.make, '__qualname__', self.make)!r} is defined in __main__ "
                             "(a notebook or a script), which the ranks cannot import: put it in a .py file "
                             "beside it and import it from there")
        try:
            pickle.dumps(self.make)
        except Exception as error:
            raise ValueError(f"make={getattr(self.make, '__qualname__', self.make)!r} cannot travel to the "
                             f"ranks ({error}): define it at the top level of a .py file they can import "
                             f"(not inside a function or a notebook cell)") from None
        if not self.split_at or not all(isinstance(name, str) and name for name in self.split_at):
            raise ValueError(f"split_at={list(self.split_at)!r}: give the module names where stages begin, "
                             f"e.g. split_at=['layers.4']")
        if len(self.example_shape) != 2 or not all(isinstance(n, int) and n > 0 for n in self.example_shape):
            raise ValueError(f"example_shape={self.example_shape!r}: give (microbatch size, sequence "
                             "length), e.g. (2, 16)")
        with torch.device("meta"):
            model = self.make()
        if not isinstance(model, nn.Module):
            raise TypeError(f"make() returned a {type(model).__name__}, not a torch.nn.Module")
        modules = dict(model.named_modules())
        missing = [name for name in self.split_at if name not in modules]
        if missing:
            children = ", ".join(name for name in modules if name and name.count(".") <= 1)
            raise ValueError(f"split_at names {missing}, which {type(model).__name__} does not have. Its "
                             f"modules: {children}")
        pipe = self._trace(model)
        self._traced.update(self._shapes(pipe))

    def _trace(self, model: nn.Module):
        """torch's tracer on `model` with a split point at each name (on the model's device)."""
        from torch.distributed.pipelining import SplitPoint, pipeline

        device = next(iter(model.parameters()), torch.empty(0)).device
        example = torch.zeros(self.example_shape, dtype=torch.long, device=device)
        try:
            with warnings.catch_warnings():  # torch 2.13's own tracer trips its own pytree deprecation
                warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
                pipe = pipeline(model, mb_args=(example,),
                                split_spec={name: SplitPoint.BEGINNING for name in self.split_at})
        except Exception as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ValueError(f"torch's tracer cannot trace {type(model).__name__}'s forward: {reason}. "
                             f"Make its forward traceable (no data-dependent Python control flow), or, for "
                             f"a Hugging Face decoder, describe its parts with "
                             f"pplab.models.hf.HFModel.of(config, "
                             f"layout=pplab.models.hf.Layout(...))") from None
        if pipe.num_stages != len(self.split_at) + 1:
            raise ValueError(f"split_at={list(self.split_at)!r} cut the forward into {pipe.num_stages} "
                             f"stages, not {len(self.split_at) + 1}: give each name once, in forward order")
        return pipe

    def _shapes(self, pipe) -> dict:
        """The activation width and vocabulary, read off a meta run of the traced stages."""
        batch, seq = self.example_shape
        x = torch.zeros(self.example_shape, dtype=torch.long, device="meta")
        widths = []
        for index in range(pipe.num_stages):
            x = pipe.get_stage_module(index)(x)
            last = index == pipe.num_stages - 1
            if not isinstance(x, torch.Tensor):
                what = "output" if last else f"boundary after stage {index}"
                raise ValueError(f"the {what} is {_describe(x)}: pplab sends one tensor between "
                                 "stages and scores logits [batch, seq, vocab]; move the split "
                                 f"point ({self.split_at[min(index, len(self.split_at) - 1)]!r}) "
                                 "or return a tensor")
            if x.dim() != 3 or tuple(x.shape[:2]) != (batch, seq) or not x.is_floating_point():
                what = "logits" if last else f"the activation after stage {index}"
                raise ValueError(f"{what} have shape {tuple(x.shape)} ({x.dtype}): pplab needs "
                                 f"[batch, seq, {'vocab' if last else 'hidden'}] = [{batch}, {seq}, ...]")
            widths.append(x.shape[-1])
        owners = {name: index for index in range(pipe.num_stages)
                  for name, _ in pipe.get_stage_module(index).named_parameters()}
        hidden = set(widths[:-1])
        if len(hidden) != 1:
            raise ValueError(f"the stages pass activations of widths {widths[:-1]}: pplab's runtimes need "
                             f"one hidden width at every boundary")
        return {"hidden_size": hidden.pop(), "vocab_size": widths[-1], "owners": owners}

    # --- the sizes every model description has -------------------------------------------------

    @property
    def num_hidden_layers(self) -> int:
        """The pieces the tracer cuts: one stage each (so n_stages must be len(split_at) + 1)."""
        return len(self.split_at) + 1

    @property
    def hidden_size(self) -> int:
        return self._sizes()["hidden_size"]

    @property
    def vocab_size(self) -> int:
        return self._sizes()["vocab_size"]

    @property
    def max_position_embeddings(self) -> int:
        return self.example_shape[1]

    def _sizes(self) -> dict:
        if not self._traced:
            with torch.device("meta"):
                self._traced.update(self._shapes(self._trace(self.make())))
        return self._traced

    def check_stages(self, n_stages: int, balance) -> None:
        """Refuse a schedule whose stage count is not the cut's."""
        if balance is not None:
            raise ValueError(f"balance={list(balance)!r} with a traced model: its stages are where split_at "
                             f"cuts; move the split points instead")
        if n_stages != self.num_hidden_layers:
            raise ValueError(f"split_at={list(self.split_at)!r} makes {self.num_hidden_layers} stages but "
                             f"the schedule has n_stages={n_stages}: give {n_stages - 1} split points, or a "
                             f"schedule with {self.num_hidden_layers} stages")

    def check_microbatch_shape(self, shape) -> None:
        """Refuse a microbatch of another shape than the traced one (its graph holds those sizes)."""
        if tuple(shape) != self.example_shape:
            raise ValueError(f"microbatches of shape {tuple(shape)}, but the model was traced for "
                             f"{self.example_shape}: make it with TracedModel(..., example_shape="
                             f"{tuple(shape)}), or split the batch into microbatches of that shape")

    # --- building ---------------------------------------------------------------------------------

    def build_model(self, seed: int = 0, device="cpu") -> nn.Module:
        """The whole model on one device, as `make()` builds it under `seed`."""
        torch.manual_seed(seed)
        with torch.device("cpu"):
            model = self.make()
        return model.to(device)

    def build_stage(self, layers: range, embed: bool, head: bool, seed: int = 0, device="cpu") -> nn.Module:
        """Stage `layers.start` of the cut: the traced piece of the forward, with the model's modules."""
        pipe = self._trace(self.build_model(seed))
        stage = pipe.get_stage_module(layers.start)
        stage.register_forward_pre_hook(self._check_input(embed))
        return stage.to(device)

    def _check_input(self, first: bool):
        def check(module, inputs):
            (x,) = inputs
            if first:
                check_token_ids(x)
            self.check_microbatch_shape(x.shape[:2])
        return check

    def parameter_names(self) -> list[str]:
        """The whole model's parameter names, in its order."""
        with torch.device("meta"):
            return [name for name, _ in self.make().named_parameters()]

    def part_of(self, name: str) -> int:
        """The piece (stage) that holds parameter `name`."""
        owners = self._sizes()["owners"]
        if name not in owners:
            raise KeyError(f"{name!r} is not a parameter of any stage")
        return owners[name]

    def record(self) -> dict:
        """What a checkpoint manifest says about this model."""
        return {"traced.make": f"{getattr(self.make, '__module__', '')}."
                               f"{getattr(self.make, '__qualname__', repr(self.make))}",
                "traced.split_at": list(self.split_at), "traced.example_shape": list(self.example_shape)}


def _describe(value) -> str:
    if isinstance(value, (tuple, list)):
        return f"{len(value)} values ({', '.join(type(v).__name__ for v in value)})"
    return f"a {type(value).__name__}"
