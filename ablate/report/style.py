"""How the figures tell arms apart: a colour each (tab10, tab20 beyond ten arms), names under
bars cut so that they neither overlap nor collide, and lines at one x set a little aside so that
their error bars stay apart."""
from __future__ import annotations

import matplotlib
import numpy as np
import pandas as pd

TICK_LABEL_CHARS = 24     # an arm's name under its bar is cut in the middle beyond this


def palette(index: int, count: int) -> str:
    """Colour `index` of `count`: matplotlib's ten (C0..C9), or tab20's twenty for more arms."""
    if count <= 10:
        return f"C{index % 10}"
    return matplotlib.colors.to_hex(matplotlib.colormaps.get_cmap("tab20")(index % 20))


def short_label(text: str, width: int = TICK_LABEL_CHARS) -> str:
    """A label cut in the middle to `width` characters (long arm names under bars would overlap)."""
    if len(text) <= width:
        return text
    tail = (width - 2) // 2
    return text[:width - 2 - tail] + ".." + text[-tail:]


def short_labels(texts: list[str], width: int = TICK_LABEL_CHARS) -> list[str]:
    """Each label cut to `width`; labels whose cuts collide show the part where they differ instead
    ('..size=16,attention=f..'), and a number where even that does not tell them apart."""
    cut = [short_label(t, width) for t in texts]
    short = list(cut)
    for i, text in enumerate(texts):
        others = [o for j, o in enumerate(texts) if cut[j] == cut[i] and o != text]
        if others:
            differ = min(next((k for k, (a, b) in enumerate(zip(text, o)) if a != b), len(text)) for o in others)
            start = max(0, min(differ - 6, len(text) - width + 2))
            short[i] = (".." + text[start:start + width - 4] + "..")[:width]
    if len(set(short)) < len(set(texts)):
        short = [s if texts.count(t) > 1 or short.count(s) == 1 else f"{s[:width - 3]}~{i:02d}"
                 for i, (s, t) in enumerate(zip(short, texts))]
    return short


def dodge(x: np.ndarray, all_x: pd.Series, i: int, n: int, spread: float = 0.12) -> np.ndarray:
    """x moved aside by line i's share of `spread` of the narrowest gap between the x values (a
    factor on a log2 axis); one line, or one x value, stays where it is."""
    values = np.unique(all_x.dropna().to_numpy(float))
    if n < 2 or values.size < 2:
        return x
    share = spread * ((i + 0.5) / n - 0.5)
    if values.min() > 0 and values.max() / values.min() >= 8:     # the log2 axis of style_x
        return x * 2 ** (share * np.diff(np.log2(values)).min())
    return x + share * np.diff(values).min()
