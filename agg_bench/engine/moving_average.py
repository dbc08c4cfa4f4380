"""Moving averages of a policy's trainable weights: ``w_ema <- w_ema + (1 - d)(w - w_ema)`` after optimizer steps.

:class:`MovingAverage` keeps one tensor per trainable parameter of the policy (by the policy's parameter names):
made from the policy's weights, it takes them in with a decay d (:meth:`MovingAverage.update`, d = 0 an exact
copy), swaps itself into the policy for a while (:meth:`MovingAverage.weights_in`, the policy's own weights put
back bit for bit after) and travels in a checkpoint (:meth:`MovingAverage.state_dict`,
:meth:`MovingAverage.from_state`, or :meth:`MovingAverage.load_state_dict` into one it holds). The methods that compute with a moving average (DiffusionNFT's old policy,
AWM's EMA-KL, DGPO's ``ema_ref``: ``baselines.final_latent.EMAPolicy``) keep its tensors inside a frozen copy of
the transformer that they call; the run's evaluation average (``train.eval_ema``) keeps bare tensors, since it is
only ever swapped in.

The evaluation average is the one of Flow-GRPO's ``flow_grpo/ema.py`` ``EMAModuleWrapper``, which DiffusionNFT
(github.com/NVlabs/DiffusionNFT, ``scripts/train_nft_sd3.py``, ``config/base.py`` ``train.ema = True``) builds over
the trainable parameters with ``decay=0.9, update_step_interval=1`` and steps after every optimizer step with the
step count n already incremented: ``d = min((1 + n) / (10 + n), decay)`` (:func:`warmup_decay`), from the
starting weights. Its ``eval_fn`` and ``save_ckpt`` swap it in (``copy_ema_to``) and back (``copy_temp_to``); the
rollout and training never use it.
"""
from __future__ import annotations

import contextlib

import torch

from ..errors import UserError


def warmup_decay(steps: int, maximum: float) -> float:
    """The decay of an update after ``steps`` optimizer steps (counted with the one just taken):
    ``min((1 + steps) / (10 + steps), maximum)`` (``EMAModuleWrapper.get_current_decay``): an average of few steps
    follows the recent weights, and the decay reaches ``maximum`` (0.9 after 80 steps)."""
    return min((1 + steps) / (10 + steps), maximum)


class MovingAverage:
    """A moving average of ``policy``'s trainable weights (module docstring), made equal to them. ``weights``:
    the tensors to hold it in, by parameter name (None: fresh copies); ``steps``: the optimizer steps it has
    taken in (the policy's ``version`` at its last update); ``version``: the policy version its weights are
    exactly (None after an update with a decay above 0). ``what`` names it in a resumed run's errors."""

    what = "moving average of the policy"

    def __init__(self, policy, weights: dict[str, torch.Tensor] | None = None):
        if weights is None:
            weights = {name: p.detach().clone() for name, p in policy.named_parameters()}
        self.weights = weights
        self.steps = policy.version
        self.version: int | None = policy.version

    def state_dict(self) -> dict:
        """Its weights (on the CPU, by the policy's parameter names), ``steps`` and ``version``: a checkpoint's."""
        return {"weights": {name: w.detach().cpu().clone() for name, w in self.weights.items()},
                "steps": self.steps, "version": self.version}

    @classmethod
    def from_state(cls, policy, state: dict, what: str | None = None):
        """The moving average ``state_dict`` saved, for ``policy``; a UserError naming it ``what`` (default: the
        class's) where it does not fit (every trainable parameter, each of its shape, and integer counts)."""
        average = cls(policy)
        average.load_state_dict(state, what)
        return average

    def load_state_dict(self, state: dict, what: str | None = None) -> None:
        """Take back ``state_dict``'s ``state`` into its own tensors, in place; a UserError as :meth:`from_state`'s."""
        what = what or self.what
        weights, own = state.get("weights"), self.weights
        if not isinstance(weights, dict) or set(weights) != set(own) or not all(
                isinstance(w, torch.Tensor) and w.is_floating_point() and w.shape == own[n].shape
                for n, w in weights.items()):
            raise UserError(f"--resume: the checkpoint's {what} does not match the model's trainable "
                            "parameters; delete it or run without --resume")
        steps, version = state.get("steps"), state.get("version")
        if type(steps) is not int or not (version is None or type(version) is int):
            raise UserError(f"--resume: the checkpoint's {what} has steps = {steps!r}, version = "
                            f"{version!r}: expected integers (version may be null)")
        with torch.no_grad():
            for name, w in weights.items():
                own[name].copy_(w)
        self.steps, self.version = steps, version

    def equals(self, policy) -> bool:
        """Whether its weights are the policy's own right now (a forward of it would repeat the policy's)."""
        return self.version == policy.version

    @torch.no_grad()
    def update(self, policy, decay: float) -> None:
        """Take in the policy's weights with ``decay`` (0: a copy of them, exactly)."""
        own = self.weights
        for name, weight in policy.named_parameters():
            if decay == 0:
                own[name].copy_(weight)
            else:
                own[name].add_(weight.detach() - own[name], alpha=1 - decay)
        self.steps = policy.version
        self.version = policy.version if decay == 0 else None

    @contextlib.contextmanager
    def weights_in(self, policy):
        """The policy itself (whatever wraps it) computing with these weights, its own put back after (however
        the block ends): as the public code swaps adapters or copies its EMA in and back."""
        params = dict(policy.named_parameters())
        saved = {name: p.detach().clone() for name, p in params.items()}
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(self.weights[name])
        try:
            yield policy
        finally:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(saved[name])
