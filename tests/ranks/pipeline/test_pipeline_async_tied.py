"""The asynchronous 1F1B pipeline with a weight tied across stages, against a one-process oracle.

The model: an embedding ``E``, linear+tanh blocks, and a head whose weight *is* ``E`` (logits
``h E^T``), split with ``split_points`` into 2 and 3 stages, so that the first stage (embedding)
and the last (head) each hold a copy of ``E``; and on 3 stages a variant with ``mix`` (``tanh(h E^T E
/ V)``) beginning the middle stage, so that all three stages hold ``E``: two mirrors, one of them
on a stage whose micro-batches are stale (weight prediction must leave it alone). The oracle
below shares no code with ringpipe's executor, staleness policies or schedules: it writes the
schedule, each stage's forward and backward (by hand, no autograd) and SGD with momentum out
plainly, and runs the stages in one process, each on its own copy of its weights (the tied one
included), in any order the messages allow. It follows docs/pipelines.md ("Tied weights") and PipeDream's definitions:

- **schedule** (PipeDream's asynchronous 1F1B): stage ``i`` of ``N`` runs forwards ``F0 ..
  F(N-1-i)``, then ``B j`` and the next ``F`` alternately, then the remaining backwards; an
  optimizer step ``S`` follows every ``step_every``-th backward and the last of the run. A run
  is one batch with ``train_step`` (filled and drained, the weights carried over), and every
  batch fed by ``stream_step`` then ``drain``: one stream, never drained between batches. Each
  micro-batch's loss is divided by the number of micro-batches of its step.
- **stale**: a stage's forward uses its weights current then; the backward reads the weights
  current at backward time with the forward's activations.
- **ws** (weight stashing): the backward runs on exactly the weights the forward used.
- **wp** (weight prediction, SpecTrain-style msnag; FTPipe's aggmsnag with ``step_every`` > 1): a
  micro-batch of staleness ``d`` runs its forward on the stage's weights predicted ``d`` SGD steps
  ahead with future gradients 0 (aggmsnag: the first predicted step adds the gradient the stage
  has accumulated so far in its step, for ``E`` the holder's own, as the others' are not known
  yet); without ``ws`` the backward reads the current weights, with ``ws`` the predicted ones.
- **ga** (Gap Aware, Barkai, Hakimi, Schuster, ICLR 2020, with a stash; SGD): on every stage but
  the last, on a step with a stale micro-batch once a step has been taken, ``g <- g / (1 + Gap/C)
  + lambda theta (1 - pen)/pen`` elementwise, ``Gap`` the largest ``|theta_now - theta_used|``
  over the step's stale micro-batches, ``C = eta (rms(v) + eps)`` with ``rms`` the bias-corrected
  running mean (0.999) of ``v^2`` after each step.
- **tied weight** (the asynchronous rule): the first holder (stage ``f``) owns ``E``. At its
  ``k``-th step it adds the other holders' ``k``-th-step gradients of ``E`` to its own, in stage
  order (it waits for them), Gap Aware (on its stage) acts on that sum, and it steps ``E`` with its
  momentum. Another holder (stage ``s``) keeps a mirror: at its ``j``-th step it hands its gradient
  of ``E`` over and does not step the mirror (no momentum for it), and after the step the mirror
  becomes the owner's ``E`` after the owner's step ``j - D``, ``D = ceil((s - f) / step_every)``
  (it waits for that step; nothing while ``j <= D``). At the end of a run every mirror becomes the
  owner's final ``E``. Weight prediction leaves the mirror as it is (no momentum to predict from);
  weight stashing keeps it with the stage's other weights.

Every run must end with the oracle's weights on every stage (both copies of ``E`` included) and
give the oracle's loss per batch, to 1e-10 in float64: through ``train_step`` per batch, and through
``stream_step`` over the same batches (a collective of the caller's between them, which a stage
waiting across batches would deadlock) then ``drain``; and with 2 replicas of the pipeline fed the
same batches (the same run).
"""

import itertools

import pytest
import torch
from torch import nn

from ringpipe.pipeline import PipelineTrainer

DT = torch.float64
V, D = 11, 6  # vocabulary, width
MICRO, BATCHES, BATCH = 4, 3, 8
LR, MOMENTUM, DECAY = 0.1, 0.9, 0.01
ATOL = 1e-10
BLOCKS = ["l1", "l2", "l3", "l4"]
#: stages -> split points; the first stage holds emb, l1, l2 (two blocks: weight stashing changes its gradients)
POINTS = {2: ["l3"], 3: ["l3", "l4"]}
#: the model with ``mix`` on 3 stages: emb, l1, l2 | mix, l3 | l4, head (three holders of E)
MID_POINTS = ["mix", "l4"]


class Mix(nn.Module):
    """``tanh(h E^T E / V)``: a middle use of the embedding's weight (a mirror on a stale stage)."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, h):
        return torch.tanh(h @ self.weight.T @ self.weight / V)


class TiedNet(nn.Module):
    """Embedding, four linear+tanh blocks, and a head whose weight is the embedding's (``mid``: and ``mix`` after l2)."""

    def __init__(self, mid=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D, dtype=DT)
        for name in BLOCKS:
            setattr(self, name, nn.Linear(D, D, dtype=DT))
        self.head = nn.Linear(D, V, bias=False, dtype=DT)
        self.head.weight = self.emb.weight
        self.mid = mid
        if mid:
            self.mix = Mix(self.emb.weight)

    def forward(self, x):
        h = self.emb(x)
        for name in BLOCKS:
            if name == "l3" and self.mid:
                h = self.mix(h)
            h = torch.tanh(getattr(self, name)(h))
        return self.head(h)


def make_data():
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, V, (BATCH,), generator=g), torch.randint(0, V, (BATCH,), generator=g))
            for _ in range(BATCHES)]


# ---------------------------------------------------------------------------------------- the oracle


def stage_layers(stages: int, mid: bool = False) -> list[list[str]]:
    """Each stage's operations: ``emb``, a block's name (linear then tanh), ``mix``, ``head``."""
    if mid:
        return [["emb", "l1", "l2"], ["mix", "l3"], ["l4", "head"]]
    if stages == 2:
        return [["emb", "l1", "l2"], ["l3", "l4", "head"]]
    return [["emb", "l1", "l2"], ["l3"], ["l4", "head"]]


def order(i: int, n: int, m: int, k: int) -> list[tuple[str, int]]:
    """Stage ``i``'s asynchronous 1F1B program for ``m`` micro-batches, a step after every ``k`` backwards."""
    warm = min(n - i, m)
    out = [("F", j) for j in range(warm)]
    nxt = warm
    for b in range(m):
        out.append(("B", b))
        if (b + 1) % k == 0 or b == m - 1:
            out.append(("S", -1))
        if nxt < m:
            out.append(("F", nxt))
            nxt += 1
    return out


def forward(layers, w, x):
    """Output and what each operation saves for its backward."""
    saved, h = [], x
    for op in layers:
        if op == "emb":
            saved.append(h)  # the token ids
            h = w["E"][h]
        elif op == "head":
            saved.append(h)
            h = h @ w["E"].T
        elif op == "mix":  # tanh(h E^T E / V)
            a = h @ w["E"].T
            saved += [h, a]
            h = torch.tanh(a @ w["E"] / V)
            saved.append(h)
        else:
            saved.append(h)
            h = torch.tanh(h @ w[op + ".W"].T + w[op + ".b"])
            saved.append(h)
    return h, saved


def backward(layers, w, saved, dy):
    """Gradients of the stage's weights and of its input; ``w`` carries the gradient, ``saved`` is the forward's."""
    grads = {name: torch.zeros_like(t) for name, t in w.items()}
    saved = list(saved)
    for op in reversed(layers):
        if op == "emb":
            grads["E"].index_add_(0, saved.pop(), dy)
            dy = None
        elif op == "head":
            a = saved.pop()
            grads["E"] += dy.T @ a
            dy = dy @ w["E"]
        elif op == "mix":
            out, a, h = saved.pop(), saved.pop(), saved.pop()
            dz = dy * (1 - out * out) / V
            grads["E"] += a.T @ dz  # through the second use, z = a E
            da = dz @ w["E"].T
            grads["E"] += da.T @ h  # through the first, a = h E^T
            dy = da @ w["E"]
        else:
            out, a = saved.pop(), saved.pop()
            dz = dy * (1 - out * out)
            grads[op + ".W"] += dz.T @ a
            grads[op + ".b"] += dz.sum(0)
            dy = dz @ w[op + ".W"]
    return grads, dy


def sgd(theta, v, g):
    """PyTorch's SGD with momentum and L2 decay: ``v <- mu v + (g + lambda theta); theta -= eta v`` (``v = d`` at first)."""
    d = g + DECAY * theta
    v = d if v is None else MOMENTUM * v + d
    return theta - LR * v, v


def staleness(program: list[tuple[str, int]]) -> dict[int, int]:
    """Micro-batch -> the number of optimizer steps between its forward and its backward."""
    steps, at_f, out = 0, {}, {}
    for kind, j in program:
        if kind == "S":
            steps += 1
        elif kind == "F":
            at_f[j] = steps
        else:
            out[j] = steps - at_f[j]
    return out


def predict(theta, v, g0, horizon):
    """Weight prediction (msnag; aggmsnag with ``g0``): ``horizon`` SGD steps ahead, future gradients 0."""
    th = theta.clone()
    for step in range(horizon):
        d = DECAY * th + (g0 if step == 0 and g0 is not None else 0)
        v = d if v is None else MOMENTUM * v + d
        th = th - LR * v
    return th


def oracle(stages: int, ws: bool, k: int, data, wp: bool = False, ga: bool = False, stream: bool = False,
           mid: bool = False):
    """Each stage's final weights (its own copy of ``E`` included) and the loss of each batch.

    ``stream``: the batches are one stream (``stream_step`` then ``drain``), else one run each.
    ``mid``: the model with ``mix`` (3 stages, ``E`` on each).
    """
    model = TiedNet(mid)
    layers = stage_layers(stages, mid)
    holders = [s for s in range(stages) if {"emb", "head", "mix"} & set(layers[s])]
    owner = holders[0]
    delay = {s: -(-(s - owner) // k) for s in holders[1:]}  # D = ceil((s - f) / step_every)
    w = []
    for s in range(stages):
        mine = {"E": model.emb.weight.detach().clone()} if s in holders else {}
        for op in layers[s]:
            if op in BLOCKS:
                mine[op + ".W"] = getattr(model, op).weight.detach().clone()
                mine[op + ".b"] = getattr(model, op).bias.detach().clone()
        w.append(mine)
    mom = [dict.fromkeys(ws_, None) for ws_ in w]
    ga_on = set(range(stages - 1)) if ga else set()  # Gap Aware on every stage but the last
    ga_stat = [{n: torch.zeros_like(t) for n, t in mine.items()} for mine in w]
    ga_n = [0] * stages
    gaps = [None] * stages
    stale_in_step = [False] * stages
    runs = [data] if stream else [[b] for b in data]
    mb_losses = []
    for run in runs:
        xs = [c for x, _ in run for c in x.tensor_split(MICRO)]
        ys = [c for _, y in run for c in y.tensor_split(MICRO)]
        total = len(xs)
        last_group = (total - 1) // k
        scale = [1.0 / (k if j // k < last_group else total - last_group * k) for j in range(total)]
        programs = [order(s, stages, total, k) for s in range(stages)]
        stale_by = [staleness(p) for p in programs]
        pc = [0] * stages
        acts, dacts = {}, {}  # (stage, mb) -> the stage's output / the gradient of its output
        kept = [{} for _ in range(stages)]  # mb -> (saved activations, the forward's weights)
        acc = [{n: torch.zeros_like(t) for n, t in w[s].items()} for s in range(stages)]
        run_loss = [None] * total
        steps = [0] * stages  # steps taken in this run
        handed = {}  # (mirror stage, step) -> its gradient of E at that step
        owner_e = {0: w[owner]["E"]}  # the owner's step -> E after it
        while any(pc[s] < len(programs[s]) for s in range(stages)):
            progressed = False
            for s in range(stages):
                if pc[s] == len(programs[s]):
                    continue
                kind, j = programs[s][pc[s]]
                if kind == "F":
                    if s > 0 and (s - 1, j) not in acts:
                        continue
                    inp = xs[j] if s == 0 else acts[(s - 1, j)]
                    used = dict(w[s])
                    if wp:  # each stage predicts the weights it steps as far as the micro-batch is stale; a mirror is not
                        used = {n: t if (n == "E" and s in delay) else
                                predict(t, mom[s][n], acc[s][n] if k > 1 else None, stale_by[s][j])
                                for n, t in w[s].items()}
                    out, saved = forward(layers[s], used, inp)
                    kept[s][j] = (saved, used)
                    if s == stages - 1:  # cross-entropy, mean over the micro-batch, scaled for its step
                        p = torch.softmax(out, dim=1)
                        run_loss[j] = float(-torch.log(p[torch.arange(len(ys[j])), ys[j]]).mean())
                        p[torch.arange(len(ys[j])), ys[j]] -= 1
                        dacts[(s, j)] = p / len(ys[j]) * scale[j]
                    else:
                        acts[(s, j)] = out
                elif kind == "B":
                    if (s, j) not in dacts:
                        continue
                    saved, w_fwd = kept[s].pop(j)
                    g, dx = backward(layers[s], w_fwd if ws else w[s], saved, dacts[(s, j)])
                    if stale_by[s][j] > 0:
                        stale_in_step[s] = True
                        if s in ga_on:  # the gap: how far the weights moved since the forward, largest in the step
                            gap = {n: (w[s][n] - w_fwd[n]).abs() for n in w[s]}
                            gaps[s] = gap if gaps[s] is None else {n: torch.maximum(gaps[s][n], gap[n]) for n in gap}
                    for n in g:
                        acc[s][n] += g[n]
                    if s > 0:
                        dacts[(s - 1, j)] = dx
                else:  # S
                    j_step = steps[s] + 1
                    grads = dict(acc[s])
                    if s == owner:  # wait for every mirror's gradient of this step, add them in stage order
                        if any((h, j_step) not in handed for h in delay):
                            progressed = True
                            continue
                        for h in sorted(delay):
                            grads["E"] = grads["E"] + handed[(h, j_step)]
                    elif s in delay:  # a mirror hands its gradient over and waits for the owner's step j - D
                        handed[(s, j_step)] = acc[s]["E"].clone()
                        if j_step > delay[s] and j_step - delay[s] not in owner_e:
                            progressed = True
                            continue
                    mirrored = {"E"} if s in delay else set()
                    if s in ga_on and stale_in_step[s] and ga_n[s] > 0:
                        # Gap Aware (SGD): g / (1 + Gap/C) + lambda theta (1 - pen)/pen, C = eta (rms(v) + eps)
                        for n in set(grads) - mirrored:
                            c = LR * ((ga_stat[s][n] / (1 - 0.999 ** ga_n[s])).sqrt() + 1e-8)
                            pen = 1 + gaps[s][n] / c
                            grads[n] = grads[n] / pen + DECAY * w[s][n] * (1 - pen) / pen
                    for n in w[s]:
                        acc[s][n] = torch.zeros_like(w[s][n])
                        if n in mirrored:
                            continue
                        w[s][n], mom[s][n] = sgd(w[s][n], mom[s][n], grads[n])
                        ga_stat[s][n] = 0.999 * ga_stat[s][n] + 0.001 * mom[s][n] * mom[s][n]
                    if s == owner:
                        owner_e[j_step] = w[s]["E"]
                    elif s in delay and j_step > delay[s]:
                        w[s]["E"] = owner_e[j_step - delay[s]]
                    ga_n[s] += 1
                    gaps[s], stale_in_step[s] = None, False
                    steps[s] = j_step
                pc[s] += 1
                progressed = True
            assert progressed, "the oracle's schedule deadlocked"
        assert len(set(steps)) == 1, steps  # every stage took as many steps
        for s in delay:  # the end of a run: every mirror takes the owner's last E
            w[s]["E"] = w[owner]["E"]
        mb_losses += run_loss
    losses = [sum(mb_losses[b * MICRO:(b + 1) * MICRO]) / MICRO for b in range(len(data))]
    return w, losses


def oracle_state(stages, ws, k, data, wp=False, ga=False, stream=False, mid=False):
    """The oracle's weights under the model's names, per stage (``emb.weight`` for every copy of ``E``)."""
    w, losses = oracle(stages, ws, k, data, wp, ga, stream, mid)
    out = []
    for mine in w:
        state = {}
        for n, t in mine.items():
            if n == "E":
                state["emb.weight"] = t
            else:
                block, kind = n.split(".")
                state[f"{block}.{'weight' if kind == 'W' else 'bias'}"] = t
        out.append(state)
    return out, losses


# ---------------------------------------------------------------------------------------- the pipeline

TIED = {"head.weight": "emb.weight", "mix.weight": "emb.weight"}  # the tied weight's names
#: (mitigations, step_every)
CASES = [("stale", 1), ("stale", 2), ("ws", 1), ("ws", 2), ("wp", 1), ("wp+ws", 1), ("wp", 2), ("wp+ws", 2),
         ("ws+ga", 1), ("ws+ga", 2), ("wp+ws+ga", 1)]


def _train(comm, stages, cases, data, mid=False):
    out = {}
    for names, k in cases:
        for stream in (False, True):
            t = PipelineTrainer(
                comm, TiedNet(mid), split_points=MID_POINTS if mid else POINTS[stages], sample=data[0][0],
                schedule="async_1f1b",
                microbatches=MICRO, mitigations=names, step_every=k, loss_fn=nn.functional.cross_entropy,
                optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=LR, momentum=MOMENTUM, weight_decay=DECAY),
            )
            feed = t.stream_step if stream else t.train_step
            losses = []
            for x, y in data:
                losses.append(feed(x if t.is_first else None, y if t.is_last else None))
                # a collective of the caller's between batches (logging): no stage waits across it
                comm.allreduce(torch.zeros(1, dtype=DT))
            if stream:
                assert t.streaming and t.in_flight == stages - 1 - t.stage  # the stream stayed open
                t.drain()
            # this stage's weights under the model's names (its copy of E under the holder's own name)
            state = {n.removeprefix("graph_module."): v.detach().clone() for n, v in t.module.state_dict().items()}
            out[(names, k, stream)] = (state, losses, t.is_last)
    return out


@pytest.mark.timeout(300)
# 3 stages in the full suite only (slow counts as e2e), to keep the inner loop short; "3mid": the model
# with mix, whose E is held by all 3 stages (two mirrors, one of them on a stale stage)
@pytest.mark.parametrize("stages", [2, pytest.param(3, marks=pytest.mark.slow),
                                    pytest.param("3mid", marks=pytest.mark.slow)])
def test_async_with_a_tied_weight_matches_the_oracle(worlds, stages):
    data = make_data()
    mid = stages == "3mid"
    stages = 3 if mid else stages
    results = worlds.spawn(_train, stages, args=(stages, CASES, data, mid))
    start = {TIED.get(n, n): v.detach() for n, v in TiedNet(mid).state_dict().items()}
    bad = []
    for (names, k), stream in itertools.product(CASES, (False, True)):
        chosen = names.split("+")
        want, want_losses = oracle_state(stages, "ws" in chosen, k, data, "wp" in chosen, "ga" in chosen, stream,
                                         mid)
        how = "stream_step+drain" if stream else "train_step"
        for s, rank_out in enumerate(results):
            state, losses, is_last = rank_out[(names, k, stream)]
            # a holder lists its copy of E under one of its two names
            got = {TIED.get(n, n): v for n, v in state.items()}
            assert set(got) == set(want[s]), (names, k, s, sorted(state), sorted(want[s]))
            for n, v in want[s].items():
                err = float((got[n] - v).abs().max())
                moved = float((v - start[n]).abs().max())
                if err > ATOL or moved < 1e-3:
                    bad.append(f"{how} {names} step_every={k} stage {s} {n}: error {err:.3g}, moved {moved:.3g}")
            if is_last and losses != pytest.approx(want_losses, abs=ATOL, rel=0):
                bad.append(f"{how} {names} step_every={k} losses {losses} != {want_losses}")
    assert not bad, "\n".join(bad)


def test_the_oracle_tells_stale_from_ws_and_keeps_the_copies_equal():
    """Stale and ws differ in the oracle (the first stage's two blocks), so the ws cases test the stash."""
    data = make_data()
    for stages in (2, 3):
        stale, _ = oracle(stages, False, 1, data)
        stashed, _ = oracle(stages, True, 1, data)
        assert float((stale[0]["l1.W"] - stashed[0]["l1.W"]).abs().max()) > 1e-6
        # both copies of the tied weight stay equal in the oracle too
        assert torch.equal(stale[0]["E"], stale[-1]["E"])


def _train_replicated(comm, cases, data):
    """2 stages x 2 replicas, each replica fed the same batches: the same run as one pipeline."""
    out = {}
    for names, k in cases:
        t = PipelineTrainer(
            comm, TiedNet(), split_points=POINTS[2], sample=data[0][0], schedule="async_1f1b", replicas=2,
            microbatches=MICRO, mitigations=names, step_every=k, loss_fn=nn.functional.cross_entropy,
            optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=LR, momentum=MOMENTUM, weight_decay=DECAY),
        )
        for x, y in data:
            t.stream_step(x if t.is_first else None, y if t.is_last else None)
        t.drain()
        state = {n.removeprefix("graph_module."): v.detach().clone() for n, v in t.module.state_dict().items()}
        out[(names, k)] = (t.stage, state)
    return out


@pytest.mark.timeout(300)
@pytest.mark.slow  # 4 ranks on 2 cores
def test_replicas_of_a_pipeline_with_a_tied_weight_match_the_oracle(worlds):
    # each replica's owner and mirror talk to each other only; the replicas average every gradient first
    data = make_data()
    cases = [("wp+ws+ga", 1), ("ws", 2)]
    results = worlds.spawn(_train_replicated, 4, args=(cases, data))
    for names, k in cases:
        chosen = names.split("+")
        want, _ = oracle_state(2, "ws" in chosen, k, data, "wp" in chosen, "ga" in chosen, stream=True)
        for rank_out in results:
            stage, state = rank_out[(names, k)]
            got = {TIED.get(n, n): v for n, v in state.items()}
            assert set(got) == set(want[stage])
            for n, v in want[stage].items():
                assert float((got[n] - v).abs().max()) <= ATOL, (names, k, stage, n)
