"""Host-to-device copy rates on a GPU machine (torch): from pageable memory, from the same memory
page-locked after the fact (cudaHostRegister, what eagle-check's kept streamed layers use), and
from pinned allocations; the locking and allocation costs too. Thirty buffers of 436 MiB (one
Llama-3.1-8B-shape layer in bf16 each). Then the same buffers as anonymous mappings with and
without transparent huge pages asked for (madvise MADV_HUGEPAGE, what eagle-check's read
buffers ask for): the first touch, the locking, the copies, the unlocking and the unmapping.
Run: python3 benches/gpu/h2d.py"""
import mmap, time, torch
def t(f):
    torch.cuda.synchronize(); s = time.perf_counter(); r = f(); torch.cuda.synchronize(); return time.perf_counter() - s, r
n = 436 << 20  # one 8B-shape layer in bf16, bytes
k = 30
dev = torch.empty(n, dtype=torch.uint8, device="cuda")
rt = torch.cuda.cudart()
for label, pin in (("pageable", False), ("pinned", True)):
    secs, bufs = t(lambda: [torch.empty(n, dtype=torch.uint8, pin_memory=pin) for _ in range(k)])
    print(f"alloc {k} x 436 MiB {label}: {secs:.3f} s ({k*n/secs/1e9:.1f} GB/s)", flush=True)
    secs, _ = t(lambda: [b.fill_(1) for b in bufs])
    print(f"touch {label}: {secs:.3f} s ({k*n/secs/1e9:.1f} GB/s)", flush=True)
    for rep in range(2):
        secs, _ = t(lambda: [dev.copy_(b, non_blocking=pin) for b in bufs])
        print(f"h2d {label} rep {rep}: {secs:.3f} s ({k*n/secs/1e9:.1f} GB/s)", flush=True)
    if not pin:
        secs, errs = t(lambda: [rt.cudaHostRegister(b.data_ptr(), n, 0) for b in bufs])
        print(f"register {k} x 436 MiB: {secs:.3f} s ({k*n/secs/1e9:.1f} GB/s) errors {set(int(e) for e in errs)}", flush=True)
        for rep in range(2):
            secs, _ = t(lambda: [dev.copy_(b, non_blocking=True) for b in bufs])
            print(f"h2d registered rep {rep}: {secs:.3f} s ({k*n/secs/1e9:.1f} GB/s)", flush=True)
        secs, _ = t(lambda: [rt.cudaHostUnregister(b.data_ptr()) for b in bufs])
        print(f"unregister: {secs:.3f} s", flush=True)
    del bufs

for rep in range(2):
    for huge in (False, True):
        label = "huge pages" if huge else "4 KiB pages"
        maps = [mmap.mmap(-1, n) for _ in range(k)]
        if huge:
            for m in maps:
                m.madvise(mmap.MADV_HUGEPAGE)
        bufs = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
        secs, _ = t(lambda: [b.fill_(1) for b in bufs])
        print(f"[{label} {rep}] touch: {secs:.3f} s ({k*n/secs/1e9:.1f} GB/s)", flush=True)
        secs, errs = t(lambda: [rt.cudaHostRegister(b.data_ptr(), n, 0) for b in bufs])
        print(f"[{label} {rep}] register: {secs:.3f} s ({k*n/secs/1e9:.1f} GB/s) errors {set(int(e) for e in errs)}", flush=True)
        secs, _ = t(lambda: [dev.copy_(b, non_blocking=True) for b in bufs])
        print(f"[{label} {rep}] h2d registered: {secs:.3f} s ({k*n/secs/1e9:.1f} GB/s)", flush=True)
        secs, _ = t(lambda: [rt.cudaHostUnregister(b.data_ptr()) for b in bufs])
        print(f"[{label} {rep}] unregister: {secs:.3f} s ({secs/k*1e3:.1f} ms a buffer)", flush=True)
        del bufs
        secs, _ = t(lambda: [m.close() for m in maps])
        print(f"[{label} {rep}] unmap: {secs:.3f} s", flush=True)
