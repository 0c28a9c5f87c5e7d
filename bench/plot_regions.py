"""
The proximal regions {r : |D(r)| <= delta} of the Divergence x Estimator cells against mu, at the
default delta, one panel per divergence (upper bound solid, lower dashed, one colour per
estimator). `python bench/regions.py` prints the same regions as a table at a few mu.

    python bench/plot_regions.py                                 # every gppo.DIVERGENCES entry
    python bench/plot_regions.py --divergences kl,alpha:0.5,alpha:2 --out out/alpha.png

Writes out/gppo_regions.png by default (relative to where you run it; the folder is created).
"""
import argparse
import math
import sys
from pathlib import Path

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gppo  # noqa: E402
from bench.regions import proximal_bounds  # noqa: E402


def plot(divergences, out):
    mu = torch.logspace(-4, math.log10(0.999), 400, dtype=torch.float64)
    rows = math.ceil(len(divergences) / 3)                      # one panel per divergence
    fig, axes = plt.subplots(rows, 3, figsize=(13, 3.75 * rows), sharex=True, sharey=True,
                             squeeze=False)
    for ax, div in zip(axes.flat, divergences):
        for est, color in zip(gppo.ESTIMATORS, ("tab:blue", "tab:orange", "tab:green")):
            low, high = proximal_bounds(mu.log(), div, est, ratio_bounds=None)
            ax.plot(mu, high, color=color, label=est)
            ax.plot(mu, low, color=color, ls="--")
        ax.axhline(1, color="grey", lw=0.5)
        ax.axhspan(0.5, 10, color="grey", alpha=0.06, lw=0)     # default ratio_bounds
        ax.set(xscale="log", yscale="log", ylim=(0.05, 20),
               title=f"{div}  (delta = {gppo.default_delta(div):.4g})")
        ticks = [0.1, 0.2, 0.5, 0.8, 1.25, 2, 5, 10]
        ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
    for i in range(len(divergences), axes.size):                # empty panels: the one above
        axes.flat[i].axis("off")                                # keeps the mu axis
        axes.flat[i - 3].xaxis.set_tick_params(labelbottom=True)
        axes.flat[i - 3].set_xlabel("mu = behaviour probability of the sampled token")
    for ax in axes[-1][:len(divergences) - 3 * (rows - 1)]:
        ax.set_xlabel("mu = behaviour probability of the sampled token")
    for ax in axes[:, 0]:
        ax.set_ylabel("r = pi / mu  (upper solid, lower dashed)")
    axes.flat[0].legend(loc="upper right", title="estimator")
    fig.suptitle("GPPO proximal regions {r : |D(r)| <= delta} against mu "
                 "(shaded: ratio_bounds [0.5, 10])")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--divergences", default=",".join(gppo.DIVERGENCES),
                   help=f"comma-separated, any of {', '.join(gppo.divergence_names())} "
                        "(default: every gppo.DIVERGENCES entry)")
    p.add_argument("--out", type=Path, default=Path("out/gppo_regions.png"),
                   help="the PNG to write (default: out/gppo_regions.png)")
    args = p.parse_args(argv)
    divergences = [d.strip() for d in args.divergences.split(",") if d.strip()]
    for d in divergences:
        try:
            gppo.get_divergence(d)
        except ValueError as e:
            p.error(str(e))
    plot(divergences, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
