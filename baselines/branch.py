"""BranchGRPO (Li et al., arXiv 2509.06040; public code github.com/Fredreic1849/BranchGRPO,
``fastvideo/train_branchgrpo_flux.py``): GRPO on one tree of samples per prompt, whose shared prefixes
are sampled once and trained once.

Rollout. One root x_0 per prompt (the first noise row of its group). Every step j is the run's SDE step
(``sampling.sde``, ``sampling.eta``): one forward v = v_theta(x_j, t_j) per node alive before step j gives
the Gaussian transition N(mu_j, sigma_j^2). At a branch point j in S (``branch_points``) each node gets
K (``branch_factor``) children x_{j+1}^(k) = mu_j + s sigma_j eps_k with independent eps_k
(s = ``split_noise_scale``), elsewhere one child x_{j+1} = mu_j + sigma_j eps. A prompt's tree thus runs
K^|{b in S: b < j}| forwards at step j, has n_j = K^|{b in S: b <= j}| transitions there, and ends in
G = K^|S| leaves: the prompt's group. The trajectory holds the G leaf rows with their prefixes repeated;
``Trajectory.transitions`` names the transition each (row, step) belongs to.

Node rewards. A leaf's reward is its image's. An internal node's (``reward_fusion``):
- ``mean``: the mean reward of the leaves below it (the released script, ``TREE_PROB_WEIGHTED=false``);
- ``prob_weighted``: R(n) = sum_c softmax_c(log p(n -> c)) R(c) over its children c, log p the rollout's
  log-probability of the edge (the per-element mean, as stored); an only child passes its reward up.

Depth-wise advantages. Per prompt and per step j, over the n_j nodes step j produces:
A = clamp((R - mean) / (std + grpo.adv_eps), -grpo.adv_clip_max, grpo.adv_clip_max), the std with
``grpo.adv_ddof`` (the public code: torch's unbiased std, ddof 1, and 1e-8); A = 0 where n_j = 1 or
std < 1e-6. ``grpo.adv_std`` must be ``group`` (the spread is each prompt's nodes' at that depth).
The transition into a node carries that node's A.

Training. Every distinct transition that is not pruned is trained once, exactly: a forward with grad at
its parent's state and a backward (as ``full``), on one row among the leaves that share it (l: GRPO's
clipped term and its ``beta`` term). By default the iteration takes one optimizer step on
L = 1/K_t sum_transitions l, K_t the transitions trained this iteration, as every method does.
``transitions_per_step: n`` is the public code's update instead (its training loop after the width pruning,
with the released script's ``--gradient_accumulation_steps 12``): the K_t transitions of all trees are
shuffled, and the optimizer steps after every n of them (and after the last, fewer), each step's loss
sum_{its transitions} l / (n floor(K_t / P)), P the trees (prompts): the code's division by
gradient-accumulation steps x transitions per tree. Every step after the first trains at weights the previous
steps moved, against the rollout's log-probabilities, so GRPO's ratio clip acts there. The forwards and
backwards are those of the one-step update (each transition once); the optimizer steps are
ceil(K_t / n) per epoch, recorded as ``optimizer_steps``. The shuffle is drawn from the run's generator when
the trained steps are, so a run is reproducible and a resumed one draws what the uninterrupted one did. The
gradient clip (``train.max_grad_norm``) is the code's (``train_one_step_tree``, l.1592-1608): every full step of
n is clipped, and the last, shorter step (K_t not a multiple of n) only where no full step came before it
(K_t < n; the code's ``if grad_norm is None``); after full steps it is taken unclipped.
Replay on a frozen rollout is ``not_applicable``: a tree is not a chain rollout.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from agg_bench.config.options import Options, batch_option, option
from agg_bench.engine.grpo import TrainBatch, exact_backward, micro_batches
from agg_bench.engine.sampler import ode_step, sde_step, stochastic_steps, transition_log_prob
from agg_bench.engine.trained_steps import plan_steps
from agg_bench.errors import ConfigError
from agg_bench.machine import distributed
from agg_bench.methods.base import Estimator, ReplayCase, register_method

# the released script's split points for its 20 steps (scripts/finetune/finetune_flux_branchgrpo_8gpus.sh)
PAPER_STEPS = 20
PAPER_BRANCH_POINTS = (0, 3, 6, 9)
# a depth whose node rewards spread less than this gets A = 0 (the code's compute_hierarchical_advantages_by_depth)
TINY_STD = 1e-6


@dataclass
class BranchConfig(Options):
    """Options of BranchGRPO's tree, reward fusion and pruning. The bounds that depend on the schedule and the
    group are checked when a run is set up (``check_run``).

    ``width_pruning`` (the code's ``--width_pruning_mode`` 0/1/2, off in the released script) trains only part
    of the transitions after the last branch point:
    - ``best_per_branch`` (mode 1): per leaf, the max(1, floor(width_ratio * m)) of its m transitions there
      with the highest advantage, the earliest among equals (a leaf's chain has one advantage at every depth,
      so in effect its first steps);
    - ``best_worst`` (mode 2): all those transitions of the iteration pooled (the code pools one GPU's trees; a
      branch run is one process), keep = max(2, floor(width_ratio * N)) of them: the keep // 2 with the
      highest and the keep - keep // 2 with the lowest advantage (ties in row-major order).
    """

    branch_points: list[int] | None = option(
        None, "the steps j (0-based, the split happens at step j) where every node splits; strictly increasing, "
        "in [0, sampling.steps - 1]. null scales the released script's 0,3,6,9 of 20 steps to the run: floor(b * "
        "sampling.steps / 20), duplicates dropped (0,1,3,4 for 10 steps)", min_items=1, max_items=64,
        items={"minimum": 0, "maximum": 999})
    branch_factor: int = option(
        2, "children per split (the public code hard-codes 2); `grpo.group_size` must be branch_factor ** "
        "len(branch_points), the leaves per prompt", minimum=2, maximum=256)
    split_noise_scale: float = option(
        1.0, "multiplies the noise of the children at split steps; 1.0 is the SDE itself. The released script "
        "uses 4.0 (`--tree_split_noise_scale`, argparse default 0.3) and keeps the log-probability of the unscaled "
        "sigma_j (code l.274-279), as this option does: the ratio stays consistent (old and new use the same "
        "density) but it is not the sampling density", exclusive_minimum=0, maximum=1000)
    reward_fusion: Literal["mean", "prob_weighted"] = option(
        "mean", "internal nodes' rewards: `mean` (released script) or `prob_weighted` (`--tree_prob_weighted`: "
        "softmax of the child edges' log-probs, alpha = 1), module docstring")
    depth_pruning: list[int] = option(
        [], "distinct depths whose transitions are not trained (`--depth_pruning`); a transition's depth is its "
        "child's, step + 1, so depth sampling.steps is the last step. The code's sliding window "
        "(`--depth_pruning_slide`) is off in the released script and not offered here", unique_items=True,
        max_items=1000, items={"minimum": 1, "maximum": 1000})
    width_pruning: Literal["none", "best_per_branch", "best_worst"] = option(
        "none", "train only part of the transitions after the last branch point (class docstring); refused where "
        "it would keep all of them (none trained after the last branch point, or `width_ratio` keeping every one)")
    width_ratio: float = option(0.5, "the kept fraction of `width_pruning` (`--width_pruning_ratio`)",
                                exclusive_minimum=0, maximum=1)
    micro_batch: int | None = batch_option("transitions per forward-with-grad; null: all of one step at once")
    transitions_per_step: int | None = option(
        None, "an optimizer step after every n of the iteration's shuffled trained transitions (the released "
        "script's `--gradient_accumulation_steps 12`, module docstring); null: one step per iteration on the mean "
        "over them, as every method", minimum=1, maximum=10**6)

    def check(self) -> None:
        points = self.branch_points
        if points is not None and any(a >= b for a, b in zip(points, points[1:])):
            raise ConfigError("method.branch_points", points,
                              "null or a non-empty list of strictly increasing steps >= 0")


@dataclass
class TreeBatch(TrainBatch):
    """A TrainBatch whose loss is the sum over its trained distinct transitions divided by ``trained`` (not by
    B x N); ``picked`` (n, 2): the (row, step) of the transitions one optimizer step trains, None: every
    trained one."""

    trained: int = 1
    picked: torch.Tensor | None = None

    @property
    def loss_scale(self) -> float:
        return 1.0 / self.trained


@register_method
class BranchEstimator(Estimator):
    """Tree rollout with shared prefixes, depth-wise advantages, each distinct transition trained once."""

    name = "branch"
    config_cls = BranchConfig
    config: BranchConfig

    def __init__(self, config: BranchConfig | None = None):
        super().__init__(config)
        self.last_trained: int | None = None
        self.order_seed: int | None = None  # the shuffle of the iteration's transitions (transitions_per_step)

    # ----- the tree's shape ------------------------------------------------------------------
    def points(self, steps: int) -> list[int]:
        """The branch points of a ``steps``-step rollout (the configured ones, or the paper's scaled)."""
        if self.config.branch_points is not None:
            return list(self.config.branch_points)
        return sorted({b * steps // PAPER_STEPS for b in PAPER_BRANCH_POINTS})

    def nodes(self, steps: int) -> list[int]:
        """n_j per prompt: the nodes step j produces (= its transitions), j = 0 .. steps - 1."""
        points = self.points(steps)
        return [self.config.branch_factor ** sum(b <= j for b in points) for j in range(steps)]

    def forwards(self, steps: int) -> list[int]:
        """Per prompt, the forwards step j runs: one per node alive before it."""
        points = self.points(steps)
        return [self.config.branch_factor ** sum(b < j for b in points) for j in range(steps)]

    def trained_step_mask(self, stochastic: torch.Tensor) -> torch.Tensor:
        """(T,) True on the steps whose transitions are trained: stochastic and not depth-pruned."""
        keep = stochastic.to(torch.bool).cpu().clone()
        for depth in self.config.depth_pruning:
            if depth <= keep.numel():
                keep[depth - 1] = False
        return keep

    # ----- run checks --------------------------------------------------------------------------
    def check_run(self, cfg) -> None:
        steps, c = cfg.sampling.steps, self.config
        points = self.points(steps)
        if points[-1] > steps - 1:
            raise ConfigError("method.branch_points", points,
                              f"branch points inside the steps: strictly increasing integers in [0, {steps - 1}] "
                              f"(sampling.steps = {steps})")
        stochastic = stochastic_steps(cfg.sampling.sde, torch.linspace(1, 0, steps + 1))
        if not all(stochastic[b] for b in points):
            raise ConfigError("method.branch_points", points,
                              f"steps with a density (sampling.sde {cfg.sampling.sde!r} has none at steps "
                              f"{torch.nonzero(~stochastic).flatten().tolist()}): children would be identical")
        leaves = c.branch_factor ** len(points)
        if cfg.grpo.group_size != leaves:
            raise ConfigError("grpo.group_size", cfg.grpo.group_size,
                              f"{leaves} for method 'branch': the leaves per prompt, method.branch_factor ** "
                              f"len(method.branch_points) = {c.branch_factor} ** {len(points)}")
        if any(d > steps for d in c.depth_pruning):
            raise ConfigError("method.depth_pruning", c.depth_pruning,
                              f"depths in [1, {steps}] (a transition's depth is its step + 1; "
                              f"sampling.steps = {steps})")
        if not self.trained_step_mask(stochastic).any():
            raise ConfigError("method.depth_pruning", c.depth_pruning, "at least one trained depth left")
        if c.width_pruning != "none":
            self._check_width_pruning(cfg, stochastic)
        if cfg.train.timestep_fraction != 1.0:
            raise ConfigError("train.timestep_fraction", cfg.train.timestep_fraction,
                              "1.0 for method 'branch' (it trains every transition of its trees; "
                              "prune with method.depth_pruning or method.width_pruning)")
        if cfg.train.plan != "steps":
            raise ConfigError("train.plan", cfg.train.plan,
                              "'steps' for method 'branch' (its trees decide the trained transitions)")
        if cfg.train.minibatches > 1:
            raise ConfigError("train.minibatches", cfg.train.minibatches,
                              "1 for method 'branch' (its width pruning may pool all trees, and the public code "
                              "steps every 12 shuffled transitions, not per whole tree: method.transitions_per_step)")
        if cfg.grpo.adv_std != "group":
            raise ConfigError("grpo.adv_std", cfg.grpo.adv_std,
                              "'group' for method 'branch' (its advantages are standardised over each prompt's "
                              "nodes at one depth)")
        processes = max(distributed.current().world_size, distributed.launched_world_size())
        if processes > 1:
            raise ConfigError("method.name", "branch",
                              f"one process for method 'branch' (a tree's batch grows inside the rollout and its "
                              f"width pruning pools every tree); this run has {processes} data-parallel processes")

    def _check_width_pruning(self, cfg, stochastic: torch.Tensor) -> None:
        """Width pruning prunes: some trained transition follows the last branch point, and the count it keeps
        (:meth:`trained_mask`) is fewer than them; else it would train what ``none`` trains."""
        c, steps = self.config, cfg.sampling.steps
        last = self.points(steps)[-1]
        trained = self.trained_step_mask(plan_steps(stochastic, cfg.train.ignore_last))
        per_leaf = int(trained[last + 1:].sum())  # each leaf's trained transitions after the last split
        if per_leaf == 0:
            raise ConfigError("method.width_pruning", c.width_pruning,
                              f"'none' here: no trained transition follows the last branch point {last} "
                              f"(sampling.steps = {steps}, method.depth_pruning, train.ignore_last, the SDE's "
                              "steps without a density), so there is nothing to prune")
        if c.width_pruning == "best_per_branch":
            pool, kept = per_leaf, max(1, int(c.width_ratio * per_leaf))
            what = f"each leaf's {per_leaf} trained transition(s) after the last branch point {last}"
        else:
            pool = per_leaf * cfg.grpo.group_size * cfg.grpo.prompts_per_iteration
            kept = max(2, int(c.width_ratio * pool))
            what = f"the {pool} pooled trained transitions after the last branch point {last}"
        if kept >= pool:
            raise ConfigError("method.width_ratio", c.width_ratio,
                              f"a ratio that keeps fewer than {what} (it keeps {kept}: the same training as "
                              "method.width_pruning=none)")

    def replay_case(self, cfg, stochastic, batch_size, generator):
        return ReplayCase("not_applicable", None,
                          "BranchGRPO samples a tree per prompt (shared prefixes, children split from one "
                          "parent's mean); a frozen rollout of independent chains has no tree to train")

    # ----- rollout ---------------------------------------------------------------------------
    @torch.no_grad()
    def rollout(self, policy, cond, noise, sigmas, sampling, generator, iteration, group_size):
        from agg_bench.engine.rollout import Trajectory  # the rollout module imports the models; the options do not

        steps = sigmas.numel() - 1
        total = noise.shape[0]
        group = self.config.branch_factor ** len(self.points(steps))
        roots = torch.arange(0, total, group)
        mask = stochastic_steps(sampling.sde, sigmas)
        device = policy.device
        compute = torch.float64 if policy.dtype == torch.float64 else torch.float32
        timesteps = policy.timestep_values(sigmas).to(device=device, dtype=policy.dtype)
        x = noise[roots].to(device)
        node_cond = cond[roots].to(device)
        splits = set(self.points(steps))
        factor = self.config.branch_factor
        latents, velocities, log_probs = [x.to(compute)], [], []
        for j in range(steps):
            v = policy.velocity(x, timesteps[j].expand(x.shape[0]), node_cond).to(compute)
            velocities.append(v)
            if j in splits:  # each child draws its own noise around its parent's mean
                x, v = x.repeat_interleave(factor, 0), v.repeat_interleave(factor, 0)
                node_cond = node_cond.repeat_interleave(factor)
            if mask[j]:
                out = sde_step(sampling.sde, v, x, sigmas, j, sampling.eta, generator=generator)
                x, logp = out.prev_sample, out.log_prob
                if j in splits and self.config.split_noise_scale != 1.0:
                    x = out.mean + self.config.split_noise_scale * (out.prev_sample - out.mean)
                    logp = transition_log_prob(sampling.sde, x, out.mean, out.std)  # the unscaled std, as the public code
            else:
                x = ode_step(v, x, sigmas, j)
                logp = torch.zeros(x.shape[0], dtype=compute, device=device)
            latents.append(x)
            log_probs.append(logp)
        leaves = lambda t: t.repeat_interleave(total // t.shape[0], 0)  # prefix rows repeated
        ids, offset = [], 0
        for n in self.nodes(steps):
            width = n * roots.numel()
            ids.append(offset + torch.arange(total) // (total // width))
            offset += width
        return Trajectory(
            latents=torch.stack([leaves(t) for t in latents], 1),
            velocities=torch.stack([leaves(t) for t in velocities], 1),
            log_probs=torch.stack([leaves(t) for t in log_probs], 1), sigmas=sigmas, timesteps=timesteps,
            sde_mask=mask, policy_version=policy.version, transitions=torch.stack(ids, 1),
        )

    # ----- advantages --------------------------------------------------------------------------
    def node_rewards(self, rewards: torch.Tensor, log_probs: torch.Tensor) -> list[torch.Tensor]:
        """Per step j, (P, n_j) float64 rewards of the nodes step j produces (``reward_fusion``), from the
        leaves' ``rewards`` (B,) and the rollout's edge ``log_probs`` (B, T), rows grouped per prompt."""
        steps = log_probs.shape[1]
        nodes = self.nodes(steps)
        group = nodes[-1]
        r = rewards.to(torch.float64).view(-1, group)
        prompts = r.shape[0]
        if self.config.reward_fusion == "mean":
            return [r.view(prompts, n, group // n).mean(-1) for n in nodes]
        out = [r]
        for j in range(steps - 2, -1, -1):
            children = out[0]
            if nodes[j + 1] == nodes[j]:  # an only child passes its reward up
                out.insert(0, children)
                continue
            per_child = group // nodes[j + 1]
            edge = log_probs[:, j + 1].to(torch.float64).view(prompts, nodes[j + 1], per_child)[..., 0]
            factor = nodes[j + 1] // nodes[j]
            weights = torch.softmax(edge.view(prompts, nodes[j], factor), -1)
            out.insert(0, (weights * children.view(prompts, nodes[j], factor)).sum(-1))
        return out

    def advantages(self, rewards, trajectory, grpo):
        """(B, T): each transition's advantage, that of the node it leads to (module docstring)."""
        columns = []
        fused = self.node_rewards(rewards, trajectory.log_probs.cpu())
        group = fused[-1].shape[1]
        for r in fused:
            n = r.shape[1]
            if n == 1:
                adv = torch.zeros_like(r)
            else:
                spread = r.std(dim=1, correction=grpo.adv_ddof, keepdim=True)
                adv = (r - r.mean(dim=1, keepdim=True)) / (spread + grpo.adv_eps)
                adv = torch.where(spread < TINY_STD, torch.zeros_like(adv), adv)
            adv = adv.clamp(-grpo.adv_clip_max, grpo.adv_clip_max)
            columns.append(adv.repeat_interleave(group // n, 1).reshape(-1))  # to every leaf below the node
        return torch.stack(columns, 1).to(trajectory.latents.dtype)

    def trained_steps(self, train, trajectory, batch_size, generator):
        """Every row lists every trained step; the tree's distinct transitions are picked in accumulate."""
        steps = torch.nonzero(self.trained_step_mask(plan_steps(trajectory.sde_mask, train.ignore_last)),
                              as_tuple=False).flatten()
        if self.config.transitions_per_step is not None:  # drawn here, in the run's order of draws
            self.order_seed = int(torch.randint(2**62, (1,), generator=generator))
        return steps.expand(batch_size, -1).clone()

    # ----- training ----------------------------------------------------------------------------
    def trained_mask(self, batch: TrainBatch) -> torch.Tensor:
        """(B, T) bool: True at one row of each distinct transition that is trained (planned, not pruned)."""
        assert batch.transitions is not None  # the tree rollout records them
        ids = batch.transitions.cpu()
        b, steps = ids.shape
        planned = torch.zeros(b, steps, dtype=torch.bool)
        planned.scatter_(1, batch.train_steps.cpu(), True)
        first = torch.ones(b, steps, dtype=torch.bool)
        first[1:] = ids[1:] != ids[:-1]  # a transition's rows are consecutive: keep its first
        keep = planned & first
        if self.config.width_pruning == "none":
            return keep
        after = torch.zeros(steps, dtype=torch.bool)
        after[max(self.points(steps)) + 1:] = True
        pool = keep & after  # after the last split every leaf row is its own transition
        adv = batch.advantages.detach().cpu().to(torch.float64)  # (B, T): this method's own
        ratio = self.config.width_ratio
        chosen = torch.zeros_like(pool)
        if self.config.width_pruning == "best_per_branch":
            for row in range(b):
                cols = torch.nonzero(pool[row]).flatten()
                if cols.numel():
                    order = torch.sort(adv[row, cols], descending=True, stable=True).indices
                    chosen[row, cols[order[:max(1, int(ratio * cols.numel()))]]] = True
        else:
            rows, cols = torch.nonzero(pool, as_tuple=True)  # row-major; the stable sort keeps that order among equals
            if rows.numel():
                order = torch.sort(adv[rows, cols], descending=True, stable=True).indices
                n = rows.numel()
                count = max(2, int(ratio * n))
                best, worst = count // 2, count - count // 2
                picked = torch.cat([order[:best], order[max(best, n - worst):]])
                chosen[rows[picked], cols[picked]] = True
        return (keep & ~after) | chosen

    def update_parts(self, batch, train, group_size):
        """One part (the whole tree) by default; with ``transitions_per_step`` n, the iteration's trained
        transitions shuffled and cut into parts of n (module docstring)."""
        n = self.config.transitions_per_step
        if n is None:
            return [batch]
        trained = self.trained_mask(batch)
        self.last_trained = int(trained.sum())
        rows, steps = torch.nonzero(trained, as_tuple=True)
        if self.order_seed is None:
            raise RuntimeError("branch: the update's shuffle was not drawn (trained_steps makes the batch)")
        order = torch.randperm(rows.numel(), generator=torch.Generator().manual_seed(self.order_seed))
        picked = torch.stack([rows[order], steps[order]], 1)
        trees = batch.batch_size // group_size
        divisor = n * max(1, self.last_trained // trees)  # the code's accumulation steps x transitions per tree
        fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(TrainBatch)}
        full = picked.shape[0] // n
        # the code clips after every full step and at the shorter last one only where no full step came before
        return [TreeBatch(**{**fields, "clip_gradient": start + n <= picked.shape[0] or full == 0},
                          trained=divisor, picked=picked[start:start + n])
                for start in range(0, picked.shape[0], n)]

    def accumulate(self, policy, batch, stats, reference=None):
        if isinstance(batch, TreeBatch) and batch.picked is not None:  # one optimizer step's transitions
            tree, picked = batch, batch.picked
        else:
            trained = self.trained_mask(batch)
            self.last_trained = int(trained.sum())
            tree = TreeBatch(**{f.name: getattr(batch, f.name) for f in dataclasses.fields(TrainBatch)},
                             trained=max(self.last_trained, 1))
            picked = torch.nonzero(trained)
        for j in torch.unique(picked[:, 1]).tolist():  # by step: one forward per micro-batch of its rows
            rows = picked[picked[:, 1] == j, 0]
            for chunk in micro_batches(rows.numel(), self.config.micro_batch):
                taken = rows[chunk]
                exact_backward(policy, tree, taken, torch.full_like(taken, j), stats, reference)

    def records_optimizer_steps(self) -> bool:
        return self.config.transitions_per_step is not None

    def iteration_metrics(self) -> dict:
        return {"trained_transitions": self.last_trained}
