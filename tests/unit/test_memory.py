"""The CPU meter against allocations whose sizes are known exactly."""

import torch

from slimtune.device import memory


def test_counts_known_allocations_and_frees():
    meter = memory.LiveBytesMeter()
    with meter:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 B
        b = torch.empty(250, dtype=torch.float64)  # 2000 B
        assert meter.current == 6000
        view = a[10:]  # a view adds no storage
        assert meter.current == 6000
        del a
        assert meter.current == 6000  # the view keeps the storage alive
        del view
        assert meter.current == 2000
        c = torch.empty(500, dtype=torch.float32)
        del b, c
    assert meter.peak == 6000
    assert meter.current == 0


def test_peak_inside_a_matmul_includes_its_output():
    x = torch.randn(64, 32)
    w = torch.randn(32, 16)
    meter = memory.LiveBytesMeter()
    meter.track([x, w])
    with meter:
        y = x @ w
    assert meter.current == (64 * 32 + 32 * 16 + 64 * 16) * 4
    assert meter.peak == meter.current
    del y


def test_host_resident_storage_is_not_counted():
    pinned_pool = memory.mark_host_resident(torch.empty(10_000))  # allocated by the runtime up front
    meter = memory.LiveBytesMeter()
    meter.track([pinned_pool])
    with meter:
        device = torch.empty(100)
        staged = torch.empty(1000)  # counted until the runtime declares it host memory
        assert meter.current == 4400
        memory.mark_host_resident(staged)
        assert memory.is_host_resident(pinned_pool) and not memory.is_host_resident(device)
        assert meter.current == 400
        del device, pinned_pool, staged
    assert meter.peak == 4400 and meter.current == 0


def test_backward_temporaries_are_seen():
    w = torch.randn(128, 128, requires_grad=True)
    x = torch.randn(16, 128)
    meter = memory.LiveBytesMeter()
    meter.track([w, x])
    with meter:
        loss = (x @ w).tanh().sum()
        loss.backward()
    base = (128 * 128 + 16 * 128) * 4
    # The gradient of w (64 KiB) must appear, and the saved activations before it.
    assert meter.peak >= base + 128 * 128 * 4 + 16 * 128 * 4
    assert w.grad is not None


def test_cpu_meter_detaches_from_long_lived_storage():
    weight = torch.randn(100)
    for _ in range(3):
        with memory.CpuMeter().measure([(weight, "weights")]) as reading:
            pass
        assert reading.peak == 400
    del weight  # no meter callbacks left to fire on a dead meter


def test_breakdown_by_phase_and_retag():
    weight = torch.randn(10, 10)  # 400 B
    meter = memory.LiveBytesMeter()
    meter.track([weight], "weights")
    with meter:
        with meter.phase("activations"):
            saved = torch.empty(50)  # 200 B
        with meter.phase("loss"):
            logits = torch.empty(100)  # 400 B
        grad = torch.empty(25)  # 100 B, made as a temporary
        meter.retag(grad, "gradients")
        assert meter.peak_breakdown == {"weights": 400, "gradients": 0, "optimizer": 0, "activations": 200,
                                        "loss": 400, "temporaries": 100}
        del logits
        big = torch.empty(200)  # 800 B: a new peak of 1500 without the logits
    assert meter.peak == 400 + 200 + 100 + 800
    assert meter.peak_breakdown == {"weights": 400, "gradients": 100, "optimizer": 0, "activations": 200,
                                    "loss": 0, "temporaries": 800}
    assert sum(meter.peak_breakdown.values()) == meter.peak
    del saved, grad, big


def test_a_replayed_transient_peak_is_what_running_the_call_again_shows():
    """TransientReplay under fake tensors: the second call of a key allocates the first's transient
    peak above the bytes live at that moment; the meter's peak, breakdown and segments are those of
    running every call."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def transient(x):  # leaves nothing behind; peaks at two temporaries of x's size
        y = x * 2
        z = y + 1
        del y, z

    def steps(replayed: bool):
        mode = FakeTensorMode()
        replay = memory.TransientReplay()
        with mode:
            x = torch.empty(1000)
            meter = memory.LiveBytesMeter(segments=True)
            with meter:
                for k, extra in enumerate((0, 3000, 500)):  # other bytes live around each call
                    meter.enter_segment(("call", k))
                    held = torch.empty(extra, dtype=torch.uint8)
                    if replayed:
                        replay.run("same shape", x, transient, x)
                    else:
                        transient(x)
                    del held
        return meter.peak, meter.peak_breakdown, meter.segments

    assert steps(replayed=True) == steps(replayed=False)
    assert steps(replayed=True)[0] == 4000 + 3000 + 8000
