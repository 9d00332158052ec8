"""The CPU allocation trace the memory tests read (torch's profiler, ``profile_memory=True``)."""

from torch.profiler import ProfilerActivity, profile


def allocations(fn) -> list:
    """Sizes of every CPU allocation (+) and free (-) while ``fn`` runs, in order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    return [e.nbytes() for e in events]


def peak(sizes) -> int:
    """The largest running sum of :func:`allocations`' sizes: peak extra bytes."""
    cur = top = 0
    for s in sizes:
        cur += s
        top = max(top, cur)
    return top
