"""The convolution kernels of ``kernels/conv.c`` by name, where each is valid, and the rule.

Every ``conv2d``, ``conv2d_input_grad`` and ``conv2d_weight_grad`` node calls one named
kernel, ``pe_<op>_<kernel>_<f32|f64>``:

- ``pointwise``: one GEMM over the images (1x1, stride 1, no padding, one group);
- ``depthwise``: depthwise.c's vectorised kernels (groups = in = out channels > 1);
- ``im2col``: an implicit GEMM (im2col.c; any group of a non-depthwise convolution; a
  strided input gradient is col2im of a product, a block at a time);
- ``direct``: loops over the taps (any geometry);
- ``winograd``: Winograd F(2x2, 3x3) (winograd.c; 3x3 filters at stride 1 and dilation 1,
  one group, any padding; the forward and the input gradient);
- ``winograd4``: Winograd F(4x4, 3x3) (winograd.c; where ``winograd`` is valid, and the
  weight gradient too; it takes working memory, ``winograd4_work`` elements, which the
  step plans as an output of the node: workspace.py);
- ``blocked``: conv_nhwc.c's channel-blocked depthwise kernels on NCHW maps, the
  conversion to and from NCHW{c}c folded in: each image's block of one cache line of
  channels is read into a zero-bordered block on the stack and written back as planes
  (depthwise convolutions whose blocks fit, ``blocked_fits``).

``rule_kernel`` is the heuristic used without tuning, by exports and by cross-compiled
trainers: pointwise, else blocked for a depthwise convolution whose blocks fit and, in a
build with the wide FMA vectors (``fast_gemm``: AVX2 or AVX-512), whose output map has at
most ``BLOCKED_MAX_MAP`` positions (MobileNetV2's shapes, one thread: with AVX-512 on 4x4
and 8x8 maps 0.16-0.82x the depthwise kernels' time and 0.66-0.92x NHWC's with its
conversions, from 16x16 the depthwise kernels win; built portably (SSE2) 0.12-0.44x the
depthwise kernels' and 0.52-0.93x direct loops' time up to 16x16 maps), else depthwise
where it measured faster than direct loops
(``_depthwise_wins``: at stride 1 always but for the weight gradient of maps narrower
than 32 bytes; strided, the forward and the input gradient of output rows of 128 bytes or
more and the weight gradient of 64 or more), else Winograd F(4x4, 3x3) where it has many
tiles for its channels (``_winograd4_wins``; the forward, the input gradient and the weight
gradient), else Winograd F(2x2, 3x3) for a forward or
input gradient it computes with at least ``WINOGRAD_MIN`` channels in and out (one thread,
``benchmarks/c_winograd.py``: 0.74-0.86x the implicit GEMM's time at 32 and 64 channels
built for AVX-512, 0.5-1.0x up to 512 channels built portably, 1.0-2.7x below 16) and, in a
build whose GEMM has the wide FMA micro-kernels (``fast_gemm``: AVX2 or AVX-512), writing
at most ``WINOGRAD_FAST_GEMM_MAX`` channels (the forward's output channels, the input
gradient's input channels). There the implicit GEMM wins where the op writes 128 channels
or more: F(2x2, 3x3) took 1.05-1.9x its time (ResNet-18's 128-512 channel layers, VGG's
64 -> 128 and 128 -> 128 on 8 x 8 to 32 x 32 maps), and 0.48-1.09x where it writes 32 or
64 from 128, else
im2col when a group has at least 4 channels out and a depth (channels x taps) of at
least 4, else direct.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from pockengine.ir import Node

__all__ = [
    "BLOCKED_MAX_MAP",
    "CONV_OPS",
    "KERNEL_NAMES",
    "WINOGRAD4_MIN",
    "WINOGRAD4_WEIGHT_MIN",
    "WINOGRAD_FAST_GEMM_MAX",
    "WINOGRAD_MIN",
    "ConvGeometry",
    "blocked_fits",
    "candidates",
    "conv_geometry",
    "implemented",
    "node_kernel",
    "rule_kernel",
    "winograd4_work",
]

CONV_OPS = ("conv2d", "conv2d_input_grad", "conv2d_weight_grad")
KERNEL_NAMES = ("pointwise", "depthwise", "im2col", "direct", "winograd", "winograd4", "blocked")
_DENSE_MIN = 4  # PE_DENSE_MIN in conv.c
WINOGRAD_MIN = 32  # channels in and out from which the rule takes Winograd F(2x2, 3x3)
WINOGRAD_FAST_GEMM_MAX = 64  # channels written up to which a fast-GEMM build takes it
WINOGRAD4_MIN = 8  # channels the F(4x4, 3x3) core reads from which the rule takes it
WINOGRAD4_WEIGHT_MIN = 16  # input channels from which it takes F(4x4)'s weight gradient
BLOCKED_MAX_MAP = 64  # output positions up to which the rule takes the blocked kernels
_HALO_BYTES = 32768  # PE_NHWC_HALO_BYTES in conv_nhwc.c: a bordered block on the stack
_LINE = 64  # bytes of a block's position: one cache line of channels
_TAPS = 49  # PE_NHWC_TAPS: the most filter taps the blocked kernels gather


@dataclass(frozen=True)
class ConvGeometry:
    """One convolution's sizes in the order of conv.c's geometry array (PE_G_N..GROUPS)."""

    n: int
    c: int
    h: int
    w: int
    o: int
    kh: int
    kw: int
    oh: int
    ow: int
    sh: int
    sw: int
    ph: int
    pw: int
    dh: int
    dw: int
    groups: int

    def longs(self) -> list[int]:
        """The geometry array conv.c reads (two trailing zeros: the pooling slots)."""
        return [*(int(getattr(self, k)) for k in self.__dataclass_fields__), 0, 0]

    @property
    def pointwise(self) -> bool:
        return (self.kh, self.kw, self.sh, self.sw, self.ph, self.pw, self.groups) == (
            1,
            1,
            1,
            1,
            0,
            0,
            1,
        )

    @property
    def depthwise(self) -> bool:
        return self.groups == self.c == self.o and self.c > 1

    @property
    def winograd(self) -> bool:
        """3x3, stride 1, dilation 1, one group: what winograd.c computes."""
        return (self.kh, self.kw, self.sh, self.sw, self.dh, self.dw, self.groups) == (
            3,
            3,
            1,
            1,
            1,
            1,
            1,
        )

    @property
    def dense(self) -> bool:
        return (
            not self.depthwise
            and self.o // self.groups >= _DENSE_MIN
            and self.c // self.groups * self.kh * self.kw >= _DENSE_MIN
        )


def _pair(node: Node, key: str) -> tuple[int, int]:
    value = node.attrs[key]
    if not (isinstance(value, tuple) and len(value) == 2):
        raise ValueError(f"attribute {key}={value!r} is not a pair")
    return int(value[0]), int(value[1])


def conv_geometry(node: Node) -> ConvGeometry:
    """The geometry of a conv node (any of ``CONV_OPS``, or their ``conv2d_nhwc`` and
    ``conv2d_nchwc`` forms, whose maps are NHWC or NCHW{c}c): the input, weight and output
    shapes read from whichever operands hold them, in conv.c's order (NCHW sizes)."""
    op = node.op.replace("_nhwc", "", 1).replace("_nchwc", "", 1)
    if op == "conv2d":
        x, w, y = node.inputs[0].shape, node.inputs[1].shape, node.outputs[0].shape
    elif op == "conv2d_input_grad":
        x, w, y = node.outputs[0].shape, node.inputs[1].shape, node.inputs[0].shape
    else:
        x, w, y = node.inputs[0].shape, node.outputs[0].shape, node.inputs[1].shape
    groups = node.attrs.get("groups", 1)
    if not isinstance(groups, int):
        raise ValueError(f"attribute groups={groups!r} is not an int")
    if "_nchwc" in node.op:  # blocked maps: the channels from the weight
        if op == "conv2d_input_grad":
            shape = node.attrs["x_shape"]
            if not isinstance(shape, tuple):
                raise ValueError(f"attribute x_shape={shape!r} is not a shape")
            x = tuple(int(d) for d in shape)
        elif len(x) == 5:
            x = (x[0], w[1] * groups, x[2], x[3])
        if len(y) != 5:
            raise ValueError(f"a blocked convolution's output gradient has rank {len(y)}")
        y = (y[0], w[0], y[2], y[3])
    if len(x) != 4:
        raise ValueError(f"conv2d of a rank-{len(x)} input (the C kernel takes NCHW)")
    if "_nhwc" in node.op:  # NHWC maps
        x, y = (x[0], x[3], x[1], x[2]), (y[0], y[3], y[1], y[2])
    (sh, sw), (ph, pw), (dh, dw) = (_pair(node, k) for k in ("stride", "padding", "dilation"))
    return ConvGeometry(
        x[0], x[1], x[2], x[3], w[0], w[2], w[3], y[2], y[3], sh, sw, ph, pw, dh, dw, groups
    )


def implemented(op: str, kernel: str) -> bool:
    """Whether ``pe_<op>_<kernel>_*`` exists (F(2x2, 3x3) has no weight gradient)."""
    return not (kernel == "winograd" and op == "conv2d_weight_grad")


_W4_PAD = 16  # PE_W4_PAD in winograd.c: elements between the working memory's planes


def winograd4_work(op: str, g: ConvGeometry) -> int:
    """The elements of working memory ``winograd4`` takes for ``op`` on ``g``
    (``pe_winograd4_work`` in winograd.c): 36 planes of the filters' channels, the
    transformed filters, or the weight gradient's sums (its input channels rounded up
    to 32)."""
    wide = -(-g.c // 32) * 32 if op == "conv2d_weight_grad" else g.c
    return 36 * (g.o * wide + _W4_PAD)


def _halo_fits(h: int, w: int, ph: int, pw: int) -> bool:
    return ph >= 0 and pw >= 0 and (h + 2 * ph) * (w + 2 * pw) * _LINE <= _HALO_BYTES


def _scatter_rows(o: int, s: int, k: int, d: int, size: int, p: int) -> int:
    return max((o - 1) * s + (k - 1) * d + 1, size + p)


def blocked_fits(op: str, g: ConvGeometry) -> bool:
    """Whether the ``blocked`` kernels run ``op`` on ``g`` through their bordered blocks
    (``pe_blocked_fits`` in conv_nhwc.c; elsewhere they would run the ``depthwise``
    kernels): one filter a channel, at most 49 taps, and every block of one cache line of
    channels they read and write within 32 KiB with its border."""
    if not (g.groups == g.c == g.o) or g.kh * g.kw > _TAPS:
        return False
    written = _halo_fits(g.oh, g.ow, 0, 0)
    if op != "conv2d_input_grad":
        return written and _halo_fits(g.h, g.w, g.ph, g.pw)
    if (g.sh, g.sw) == (1, 1):
        flipped = _halo_fits(g.oh, g.ow, g.dh * (g.kh - 1) - g.ph, g.dw * (g.kw - 1) - g.pw)
        return flipped and _halo_fits(g.h, g.w, 0, 0)
    rows = _scatter_rows(g.oh, g.sh, g.kh, g.dh, g.h, g.ph)
    cols = _scatter_rows(g.ow, g.sw, g.kw, g.dw, g.w, g.pw)
    return written and rows * cols * _LINE <= _HALO_BYTES


def candidates(op: str, g: ConvGeometry) -> tuple[str, ...]:
    """The kernels that compute ``op`` correctly for ``g``, in ``KERNEL_NAMES`` order
    (``blocked`` only where its blocks fit: elsewhere it is the ``depthwise`` kernel)."""
    valid = {
        "pointwise": g.pointwise,
        "depthwise": g.depthwise,
        "im2col": not g.depthwise,
        "direct": True,
        "winograd": g.winograd,
        "winograd4": g.winograd,
        "blocked": g.depthwise and blocked_fits(op, g),
    }
    return tuple(k for k in KERNEL_NAMES if valid[k] and implemented(op, k))


def _depthwise_wins(op: str, g: ConvGeometry, itemsize: int) -> bool:
    """Where the depthwise kernels measured faster than direct loops (MobileNetV2's
    shapes, AVX-512): at stride 1 the forward and input gradient always, the weight
    gradient on output rows of at least 32 bytes; strided, the forward and the input
    gradient on output rows of at least 128 bytes, the weight gradient of at least 64."""
    wide = g.ow * itemsize
    if (g.sh, g.sw) == (1, 1):
        return op != "conv2d_weight_grad" or wide >= 32
    return wide >= (64 if op == "conv2d_weight_grad" else 128)


def _winograd4_wins(op: str, g: ConvGeometry) -> bool:
    """Where F(4x4, 3x3) measured faster than the implicit GEMM and F(2x2, 3x3)
    (``benchmarks/c_winograd.py``: AVX-512 and SSE2, one thread, batch 1-8, 3-512 channels,
    maps 7-64). Enough channels on the side its vectors do not run along: the forward's
    input channels, the input gradient's output channels (``WINOGRAD4_MIN``), the weight
    gradient's input channels (``WINOGRAD4_WEIGHT_MIN``: they fill its vectors). And a 4x4
    output tile for every three channels of the wider side (every four for the weight
    gradient, which transforms no filters): with fewer tiles the filter transform (4x the
    filters, made on every call) is not paid back, 2.3-2.8x the implicit GEMM's time at
    256 channels on 14 x 14 maps (16 tiles), 0.8x at 128 channels on 28 x 28 (49 tiles)."""
    if op == "conv2d_weight_grad":
        read, least, span, (h, w) = g.c, WINOGRAD4_WEIGHT_MIN, 4, (g.oh, g.ow)
    elif op == "conv2d":
        read, least, span, (h, w) = g.c, WINOGRAD4_MIN, 3, (g.oh, g.ow)
    else:
        read, least, span, (h, w) = g.o, WINOGRAD4_MIN, 3, (g.h, g.w)
    tiles = g.n * -(-h // 4) * -(-w // 4)
    return read >= least and span * tiles >= max(g.c, g.o)


def rule_kernel(
    op: str,
    g: ConvGeometry,
    itemsize: int,
    without: Collection[str] = (),
    fast_gemm: bool = False,
) -> str:
    """The kernel the heuristic picks (see the module docstring), other than ``without``
    (the kernels that take working memory, under a memory budget), for a build whose GEMM
    has the wide FMA micro-kernels or not (``fast_gemm``; the portable rule by default)."""
    if g.pointwise:
        return "pointwise"
    small = g.oh * g.ow <= BLOCKED_MAX_MAP or not fast_gemm
    if g.depthwise and small and blocked_fits(op, g):
        return "blocked"
    if g.depthwise and _depthwise_wins(op, g, itemsize):
        return "depthwise"
    four = "winograd4" not in without and implemented(op, "winograd4")
    if g.winograd and four and _winograd4_wins(op, g):
        return "winograd4"
    made = g.o if op == "conv2d" else g.c  # the channels the op writes
    wide = min(g.c, g.o) >= WINOGRAD_MIN and not (fast_gemm and made > WINOGRAD_FAST_GEMM_MAX)
    if g.winograd and "winograd" not in without and implemented(op, "winograd") and wide:
        return "winograd"
    return "im2col" if g.dense else "direct"


def node_kernel(
    node: Node,
    g: ConvGeometry,
    chosen: Mapping[str, str],
    fast_gemm: bool = False,
    without: Collection[str] = (),
) -> str:
    """The kernel conv node ``node`` (geometry ``g``) runs: its entry in ``chosen`` (by
    first output, a measured choice), else the rule's (for a ``fast_gemm`` build or not),
    neither one of ``without`` (kernels a memory budget left out)."""
    out = node.outputs[0]
    kernel = chosen.get(out.name)
    if kernel and kernel not in without:
        return kernel
    return rule_kernel(node.op, g, out.dtype.itemsize, without, fast_gemm)
