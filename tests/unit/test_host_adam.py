"""HostAdam over flat tensors that belong to no module (as a projector's coordinates or a chunk's
slices would): its updates equal torch.optim.AdamW on the same members in float64, with weight
decay per group, clipping and a changing lr; moments in memory-mapped files train bit-identically
to moments in RAM; its state_dict resumes exactly; bf16 shadows are the masters rounded once."""

import copy

import pytest
import torch

from slimtune.optim.host_adam import Group, HostAdam, Layout

CPU = torch.device("cpu")
SETTINGS = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8}
GROUPS = [Group((torch.Size([3, 4]), torch.Size([5])), 0.1), Group((torch.Size([7]),), 0.0)]
SCHEDULE = [(1e-2, 1.0), (2e-2, 0.5), (5e-3, 1.0), (1e-2, 0.25), (1e-2, 1.0)]  # (lr, clip) per step


def gradients(step: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    return [[torch.randn(shape, generator=g, dtype=torch.float64) for shape in group.shapes] for group in GROUPS]


def start_values() -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(99)
    return [[torch.randn(shape, generator=g, dtype=torch.float64) for shape in group.shapes] for group in GROUPS]


def host_adam(**kw) -> HostAdam:
    adam = HostAdam("test", GROUPS, torch.float64, CPU, SETTINGS, **kw)
    for k, members in enumerate(start_values()):
        for i, value in enumerate(members):
            adam.member(k, i).master.copy_(value)
    adam.refresh_shadows()
    return adam


def run(adam: HostAdam, steps: range) -> None:
    for step in steps:
        lr, clip = SCHEDULE[step]
        for k, members in enumerate(gradients(step)):
            for i, grad in enumerate(members):
                adam.member(k, i).grad.add_(grad)
        adam.update(lr, clip)


def test_updates_equal_torch_adamw_on_the_same_members():
    adam = host_adam()
    run(adam, range(len(SCHEDULE)))
    params = [[torch.nn.Parameter(v.clone()) for v in members] for members in start_values()]
    reference = torch.optim.AdamW([{"params": ps, "weight_decay": g.weight_decay} for ps, g in zip(params, GROUPS)],
                                  **SETTINGS, foreach=False)
    for step, (lr, clip) in enumerate(SCHEDULE):
        for ps, grads in zip(params, gradients(step)):
            for p, grad in zip(ps, grads):
                p.grad = grad * clip
        for group in reference.param_groups:
            group["lr"] = lr
        reference.step()
    for k, ps in enumerate(params):
        for i, p in enumerate(ps):
            torch.testing.assert_close(adam.member(k, i).master, p.detach(), atol=1e-12, rtol=0)
            assert torch.count_nonzero(adam.member(k, i).grad) == 0  # accumulators emptied by the update


def test_moments_in_files_train_bit_identically_and_leave_with_the_folder(tmp_path):
    ram, disk = host_adam(), host_adam(moments_dir=tmp_path)
    run(ram, range(3))
    run(disk, range(3))
    assert all(torch.equal(a, b) for a, b in zip(ram.masters, disk.masters))
    assert len(list(tmp_path.glob("*.bin"))) == 2 * len(GROUPS)
    assert disk.host_bytes() == ram.host_bytes() - 2 * sum(m.numel() * 8 for m in ram.masters)


@pytest.mark.parametrize("moments_on_disk", [False, True])
def test_state_dict_resumes_exactly(tmp_path, moments_on_disk):
    where = {"moments_dir": tmp_path} if moments_on_disk else {}
    straight = host_adam()
    run(straight, range(len(SCHEDULE)))
    first = host_adam()
    run(first, range(2))
    saved = copy.deepcopy(first.state_dict())
    resumed = HostAdam("resumed", GROUPS, torch.float64, CPU, SETTINGS, **where)
    resumed.load_state_dict(saved)
    assert resumed.state_dict()["steps"] == [2.0, 2.0]
    run(resumed, range(2, len(SCHEDULE)))
    assert all(torch.equal(a, b) for a, b in zip(straight.masters, resumed.masters))


def test_shadows_are_the_masters_rounded_once():
    adam = HostAdam("bf16", GROUPS, torch.float32, CPU, SETTINGS, shadow_dtype=torch.bfloat16,
                    layout=Layout(split=False))
    for master in adam.masters:
        master.uniform_(-1, 1)
    adam.refresh_shadows()
    for step in range(2):
        for k, members in enumerate(gradients(step)):
            for i, grad in enumerate(members):
                adam.member(k, i).grad.add_(grad.float())
        adam.update(1e-2)
    for shadow, master in zip(adam.shadows, adam.masters):
        assert shadow.dtype == torch.bfloat16 and torch.equal(shadow, master.to(torch.bfloat16))
    assert adam.member(0, 1).shadow.shape == (5,)
    same = HostAdam("fp32", GROUPS, torch.float32, CPU, SETTINGS, shadow_dtype=torch.float32)
    assert all(s is None for s in same.shadows)  # no narrower dtype: the master itself goes up


@pytest.mark.parametrize("size", [*range(1, 18), 100_003])
def test_any_size_equals_torch_adamw_with_eps_outside_the_square_root(size):
    """lsp's d x d coordinates come in every size: the fused CPU kernel skips none (the reference's
    kernel skipped sizes not a multiple of 8) and puts eps where torch.optim.AdamW does, m / (sqrt(v) + eps)."""
    adam = HostAdam("sizes", [Group((torch.Size([size]),), 0.0)], torch.float64, CPU, SETTINGS)
    start = torch.randn(size, dtype=torch.float64, generator=torch.Generator().manual_seed(size))
    adam.member(0, 0).master.copy_(start)
    param = torch.nn.Parameter(start.clone())
    reference = torch.optim.AdamW([param], weight_decay=0.0, foreach=False, **SETTINGS)
    for step in range(3):
        grad = torch.randn(size, dtype=torch.float64, generator=torch.Generator().manual_seed(100 + step))
        adam.member(0, 0).grad.copy_(grad)
        adam.update(SETTINGS["lr"])
        param.grad = grad.clone()
        reference.step()
    torch.testing.assert_close(adam.member(0, 0).master, param.detach(), atol=1e-12, rtol=0)


# ---------------------------------------------------------------- the layouts (issue 30)

BIG = [Group((torch.Size([300, 257]), torch.Size([1000])), 0.1), Group((torch.Size([4099]),), 0.0)]


def _bf16_pair(**layout) -> tuple[HostAdam, HostAdam]:
    """A whole-master optimizer and one of `layout`, holding the same fp32 masters (their shadows too)."""
    whole = HostAdam("whole", BIG, torch.float32, CPU, SETTINGS, shadow_dtype=torch.bfloat16, layout=Layout(split=False))
    other = HostAdam("other", BIG, torch.float32, CPU, SETTINGS, shadow_dtype=torch.bfloat16, layout=Layout(**layout))
    g = torch.Generator().manual_seed(7)
    start = [[torch.randn(s, generator=g) for s in group.shapes] for group in BIG]
    whole.load_group_masters(start)
    other.load_group_masters(start)
    return whole, other


def _feed(adams: list[HostAdam], step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for k, group in enumerate(BIG):
        grad = torch.randn(group.numel, generator=g).to(torch.bfloat16)  # as a bf16 slot's gradient comes down
        for adam in adams:
            adam.grads[k].copy_(grad)


def _stored(master: torch.Tensor) -> torch.Tensor:
    """What the split layout keeps of `master` (split_master's one rule: the upper tie of an even
    weight is kept one ulp toward it)."""
    bits = master.view(torch.int32)
    top = master.to(torch.bfloat16).view(torch.int16).to(torch.int32) * 65536
    return (top + (bits - top).clamp(-32768, 32767)).view(torch.float32)


@pytest.mark.quick
def test_the_split_layout_updates_as_the_whole_master_does_bit_for_bit():
    """Each step from equal states: the split optimizer's rebuilt master is exactly what the whole
    one computes, kept by split_master's rule, and its bf16 weights are exactly the whole one's
    shadows; with bf16 gradients held as they came and clipping on the way."""
    whole, split = _bf16_pair(split=True, grad_dtype=torch.bfloat16)
    assert split.split and split.masters == [None, None] and split.grads[0].dtype == torch.bfloat16
    for step, (lr, clip) in enumerate(SCHEDULE * 4):
        _feed([whole, split], step)
        whole.update(lr, clip)
        split.update(lr, clip)
        for k in range(len(BIG)):
            assert torch.equal(split.state_dict()["masters"][k], _stored(whole.masters[k]))
            assert torch.equal(split.shadows[k], whole.shadows[k])
            assert torch.equal(split.state(k)["exp_avg_sq"], whole.state(k)["exp_avg_sq"])
            whole.masters[k].copy_(split.state_dict()["masters"][k])  # equal states again (the rule's ulp)
        assert all(torch.count_nonzero(g) == 0 for g in split.grads)


def test_the_split_layout_holds_four_bytes_a_number_where_the_whole_held_six():
    whole, split = _bf16_pair(split=True, grad_dtype=torch.bfloat16)
    numel = sum(g.numel for g in BIG)
    assert whole.host_bytes() == numel * (4 + 2 + 4 + 8)  # master, shadow, fp32 accumulator, moments
    assert split.host_bytes() == numel * (2 + 2 + 2 + 8)  # weight, residual, bf16 gradient, moments


def test_rows_of_a_split_table_are_its_fp32_master_rows():
    whole, split = _bf16_pair(split=True)
    ids = torch.tensor([[3, 299, 3], [0, 1, 2]])
    table = (300, 257)
    assert torch.equal(split.rows(0, 0, ids), _stored(whole.masters[0][: 300 * 257]).view(table)[ids])
    assert torch.equal(whole.rows(0, 0, ids), whole.masters[0][: 300 * 257].view(table)[ids])


@pytest.mark.parametrize("layout", [dict(split=True), dict(split=True, moments="8bit"), dict(split=False, moments="8bit")])
def test_every_layout_resumes_bit_for_bit_from_its_state_dict(tmp_path, layout):
    _, straight = _bf16_pair(**layout)
    _, first = _bf16_pair(**layout)
    for step in range(3):
        for adam in (straight, first):
            _feed([adam], step)
            adam.update(1e-2, 0.5)
    saved = copy.deepcopy(first.state_dict())
    resumed = HostAdam("resumed", BIG, torch.float32, CPU, SETTINGS, shadow_dtype=torch.bfloat16,
                       moments_dir=tmp_path, layout=Layout(**layout))
    resumed.load_state_dict(saved)
    for step in range(3, 6):
        for adam in (straight, resumed):
            _feed([adam], step)
            adam.update(1e-2, 0.5)
    for k in range(len(BIG)):
        assert torch.equal(resumed.state_dict()["masters"][k], straight.state_dict()["masters"][k])
        assert torch.equal(resumed.shadows[k], straight.shadows[k])
        for m in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(resumed.state_dict()[m][k], straight.state_dict()[m][k])


def test_8bit_moments_take_a_byte_and_a_256th_of_a_scale_a_number_in_files_or_ram(tmp_path):
    ram = HostAdam("ram", BIG, torch.float32, CPU, SETTINGS, shadow_dtype=torch.bfloat16,
                   layout=Layout(moments="8bit", grad_dtype=torch.bfloat16))
    disk = HostAdam("disk", BIG, torch.float32, CPU, SETTINGS, shadow_dtype=torch.bfloat16, moments_dir=tmp_path,
                    layout=Layout(moments="8bit", grad_dtype=torch.bfloat16))
    numel = sum(g.numel for g in BIG)
    scales = sum(4 * -(-g.numel // 256) for g in BIG)
    assert ram.host_bytes() == numel * (2 + 2 + 2 + 2) + 2 * scales
    assert disk.host_bytes() == numel * (2 + 2 + 2) and disk.disk_bytes() == numel * 2 + 2 * scales
    assert sum(p.stat().st_size for p in tmp_path.rglob("*.bin")) == disk.disk_bytes()
