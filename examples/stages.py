# example: stages.py
from netdist import balance_stages, split_into_stages
from netdist.parallel.schedule import build_schedule, simulate, theoretical_bubble_fraction

print([(s.start_layer, s.end_layer) for s in split_into_stages(10, 3)])
print([(s.start_layer, s.end_layer) for s in balance_stages([1, 1, 1, 1, 8, 1, 1, 1], 3)])
for kind in ("gpipe", "1f1b"):
    sim = simulate(build_schedule(kind, num_stages=4, num_micro_batches=8))
    print(f"{kind}: activations held per stage {sim.peak_stashed}, "
          f"bubble {sim.bubble_fractions[0]:.3f}")
print(f"theory: {theoretical_bubble_fraction(4, 8):.3f}")
