"""Rewrite a relax module so its heavy operators call the firmware kernel library.

``rewrite(mod, target)`` is the hook ``dspx.compiler.onnx.compile_onnx`` calls.
It returns the module and the sorted list of kernel names it imports (to be
recorded in the module's metadata and checked by the loader at DYN_LOAD).

What it does, in order:

1. fold constants (the ONNX frontend emits the conv bias as reshape(const));
   with layout="NHWC" also move convolution data to channels-last (weights
   stay OIHW) for the torch/oneDNN backend;
2. replace conv2d (+ bias add, + residual add, + ReLU), max/avg/global pooling,
   matmul/dense (+ bias, + ReLU), softmax, layer_norm and rms_norm with
   ``R.call_dps_packed("dspx.kernels.<name>", ...)`` (attributes are passed as
   ``R.prim_value`` / ``R.shape`` arguments, see dspx.device.core.kernels); then
   mark tensors that only travel from kernel to kernel as blocked, so the
   backend keeps them in its NCHWc layout (no reorder between kernels);
3. legalize, fuse and schedule the remaining glue: elementwise producers
   inlined, the innermost loop vectorized by 16, the outer loops fused and
   parallel over the target's cores when the nest is large.

The kernel names are hard-coded here on purpose: the compiler runs on the
host and must not import the device package (dspx.device.core.kernels holds the
same list; a test checks they agree).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax, tirx

log = logging.getLogger(__name__)

from dspx.abi.kernels import (ACT_NONE, ACT_RELU, BLOCK_MULTIPLE, BLOCKED_ARGS, IN_BLOCKED,  # noqa: F401
                              KERNELS, LAYOUT_NCHW, LAYOUT_NHWC, OUT_BLOCKED, PREFIX, RES_BLOCKED)
from dspx.compiler.target import target_cores

# where each blocked-capable kernel's layout code sits in its argument list
_LAYOUT_ARG = {k: KERNELS[k].position("layout") for k in BLOCKED_ARGS}

#: every kernel this pass may emit (subset of the firmware's export table)
EMITTED = frozenset(PREFIX + n for n in (
    "conv2d", "conv2d_add", "conv2d_qw", "conv2d_add_qw", "dense_qw", "max_pool2d", "avg_pool2d", "global_avg_pool2d",
    "dense", "matmul", "softmax", "layernorm", "rmsnorm"))


class RewriteError(ValueError):
    """The module cannot be rewritten (e.g. not a relax IRModule)."""


# ---------------------------------------------------------------- helpers

def _op(expr) -> str | None:
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
        return expr.op.name
    return None


def _shape(expr) -> list[int] | None:
    ty = expr.ty if hasattr(expr, "ty") else None
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    try:
        return [int(v) for v in ty.shape.values]
    except (TypeError, AttributeError):
        return None  # symbolic


def _dtype(expr) -> str | None:
    ty = getattr(expr, "ty", None)
    return ty.dtype if isinstance(ty, relax.TensorType) else None


def _ints(arr) -> list[int]:
    return [int(v) for v in arr]


def _shape_arg(vals) -> relax.ShapeExpr:
    return relax.ShapeExpr([int(v) for v in vals])


def _i(v: int):
    return relax.prim_value(int(v))


def _f(v: float):
    return relax.prim_value(tirx.FloatImm("float64", float(v)))


def _pv_int(pv) -> int:
    v = pv.value
    return int(v.value) if hasattr(v, "value") else int(v)


def _f32(*exprs) -> bool:
    return all(_dtype(e) == "float32" for e in exprs)


def _bias_shapes(layout: int, c: int) -> list[list[int]]:
    """Shapes that broadcast a per-channel vector onto a 4-D tensor in `layout`."""
    if layout == LAYOUT_NCHW:
        return [[1, c, 1, 1], [c, 1, 1]]
    return [[c], [1, c], [1, 1, c], [1, 1, 1, c]]


@dataclass
class _Rewrite:
    """The kernel call that replaces one binding: kernel name + args (original exprs)."""
    kernel: str
    args: list


# ---------------------------------------------------------------- matching

class _Matcher:
    """Looks at one function's bindings and finds the kernel calls that replace them."""

    def __init__(self, func: relax.Function):
        self.defs: dict = {}
        self.uses: dict = {}
        for block in func.body.blocks:
            for b in block.bindings:
                if isinstance(b, relax.VarBinding):
                    self.defs[b.var] = b.value
                    for v in relax.analysis.free_vars(b.value):
                        self.uses[v] = self.uses.get(v, 0) + 1
        self.outputs = list(relax.analysis.free_vars(func.body.body))
        for v in self.outputs:
            self.uses[v] = self.uses.get(v, 0) + 1
        self.rewrites: dict = {}
        self.swallowed: set = set()

    def value(self, var):
        return self.defs.get(var) if isinstance(var, relax.Var) else None

    def single(self, var) -> bool:
        return isinstance(var, relax.Var) and self.uses.get(var, 0) == 1 and var in self.defs

    def stored_weight(self, w):
        """(stored, scale) when the float32 weight ``w`` is restored from a
        reduced-precision weight (dspx.compiler.weights): astype(float16 W) ->
        (W, None); astype(int8 Q) * S -> (Q, S).  None otherwise."""
        v = self.value(w)
        if _op(v) == "relax.astype" and _dtype(v.args[0]) == "float16" and isinstance(v.args[0], relax.Var) \
                and v.args[0] not in self.defs:
            return v.args[0], None
        if _op(v) == "relax.multiply":
            for c, sc in (v.args, v.args[::-1]):
                cv = self.value(c)
                if (_op(cv) == "relax.astype" and _dtype(cv.args[0]) == "int8" and _f32(sc)
                        and isinstance(cv.args[0], relax.Var) and cv.args[0] not in self.defs):
                    return cv.args[0], sc
        return None

    # conv2d [+ bias] [+ residual] [+ relu]
    def conv_chain(self, var):
        """Return (conv_call, bias, residual, act) if var is the end of a conv chain.

        The intermediate vars the chain swallows are left in self.inner.
        """
        self.inner = []
        act = ACT_NONE
        expr = self.value(var)
        if _op(expr) == "relax.nn.relu":
            act, var = ACT_RELU, expr.args[0]
            if not self.single(var):
                return None
            expr = self.value(var)
            self.inner.append(var)
        residual = bias = None
        for _ in range(2):
            if _op(expr) == "relax.add":
                a, b = expr.args
                for x, other in ((a, b), (b, a)):
                    if not self.single(x):
                        continue
                    inner = self.value(x)
                    is_conv_side = _op(inner) in ("relax.nn.conv2d", "relax.add")
                    if not is_conv_side:
                        continue
                    if bias is None and self._is_bias(other, expr):
                        bias, var, expr = other, x, inner
                        self.inner.append(x)
                        break
                    if residual is None and _shape(other) == _shape(expr) and _f32(other):
                        residual, var, expr = other, x, inner
                        self.inner.append(x)
                        break
                else:
                    return None
        if _op(expr) != "relax.nn.conv2d":
            return None
        return expr, bias, residual, act

    def _is_bias(self, other, add_expr) -> bool:
        """Shaped like a per-channel vector in NCHW or NHWC; match_conv checks
        it against the convolution's actual layout."""
        s, o = _shape(other), _shape(add_expr)
        if s is None or o is None or len(o) != 4 or not _f32(other):
            return False
        return s in _bias_shapes(LAYOUT_NCHW, o[1]) or s in _bias_shapes(LAYOUT_NHWC, o[3])

    def match_conv(self, var) -> _Rewrite | None:
        m = self.conv_chain(var)
        if m is None:
            return None
        conv, bias, residual, act = m
        a = conv.attrs
        x, w = conv.args
        layout = {"NCHW": LAYOUT_NCHW, "NHWC": LAYOUT_NHWC}.get(str(a.data_layout))
        if (layout is None or str(a.kernel_layout) != "OIHW"
                or str(a.out_layout) != str(a.data_layout) or not _f32(x, w)
                or (str(a.out_dtype) not in ("", "float32", "void", "None"))):
            return None
        ws, os_ = _shape(w), _shape(conv)
        if ws is None or os_ is None:
            return None
        cout = ws[0]
        # the channel axis of the bias must be the layout's channel axis
        if bias is not None:
            if _shape(bias) not in _bias_shapes(layout, cout):
                return None  # e.g. an NCHW add of a (W,) vector: not a bias
            bias = ("reshape", bias, cout)
        else:
            bias = ("zeros", cout)
        pad = _ints(a.padding)
        if len(pad) == 2:
            pad = pad + pad
        attrs = [_shape_arg(a.strides), _shape_arg(pad), _shape_arg(a.dilation),
                 _i(a.groups), layout, _i(act)]
        stored = self.stored_weight(w)
        scale = []
        if stored is not None:
            w = stored[0]
            scale = [("reshape", stored[1], cout)] if stored[1] is not None else []
        suffix = "_qw" if scale else ""
        if residual is not None:
            return _Rewrite(PREFIX + "conv2d_add" + suffix, [x, w, bias, residual] + scale + attrs)
        return _Rewrite(PREFIX + "conv2d" + suffix, [x, w, bias] + scale + attrs)

    def match_dense(self, var) -> _Rewrite | None:
        self.inner = []
        expr = self.value(var)
        bias = None
        act = ACT_NONE
        if _op(expr) == "relax.nn.relu" and self.single(expr.args[0]):
            inner = self.value(expr.args[0])
            if _op(inner) in ("relax.add", "relax.matmul"):
                self.inner.append(expr.args[0])
                act, expr = ACT_RELU, inner
        if _op(expr) == "relax.add":
            a, b = expr.args
            for x, other in ((a, b), (b, a)):
                if self.single(x) and _op(self.value(x)) == "relax.matmul":
                    n = (_shape(expr) or [0])[-1]
                    if _shape(other) in ([n], [1, n]) and _f32(other):
                        bias, expr = other, self.value(x)
                        self.inner.append(x)
                        break
            else:
                return None
        if _op(expr) != "relax.matmul":
            return None
        x, w = expr.args
        xs, ws, os_ = _shape(x), _shape(w), _shape(expr)
        if xs is None or ws is None or os_ is None or not _f32(x, w):
            return None
        if str(expr.attrs.out_dtype) not in ("", "float32", "void", "None"):
            return None
        if len(ws) == 2 and len(xs) >= 2:
            trans_b = 0
            wv = self.value(w)
            if (_op(wv) == "relax.permute_dims" and self.single(w)
                    and _ints(wv.attrs.axes or [1, 0]) == [1, 0]):
                self.inner.append(w)
                w, trans_b = wv.args[0], 1  # keep the stored (N, K) weight
            n = os_[-1]
            b = ("reshape", bias, n) if bias is not None else ("zeros", n)
            stored = self.stored_weight(w)
            if stored is not None and stored[1] is not None:
                return _Rewrite(PREFIX + "dense_qw", [x, stored[0], b, ("reshape", stored[1], n),
                                                   _i(trans_b), _i(act)])
            if stored is not None:
                w = stored[0]
            return _Rewrite(PREFIX + "dense", [x, w, b, _i(trans_b), _i(act)])
        if bias is not None or act != ACT_NONE or len(xs) < 2 or len(ws) < 2:
            return None
        return _Rewrite(PREFIX + "matmul", [x, w, _i(0)])

    def match_single(self, expr) -> _Rewrite | None:
        op = _op(expr)
        if op in ("relax.nn.max_pool2d", "relax.nn.avg_pool2d"):
            a = expr.attrs
            x = expr.args[0]
            layout = {"NCHW": LAYOUT_NCHW, "NHWC": LAYOUT_NHWC}.get(str(a.layout))
            if layout is None or str(a.out_layout) != str(a.layout) or not _f32(x):
                return None
            pad = _ints(a.padding)
            if len(pad) == 2:
                pad = pad + pad
            common = [_shape_arg(a.pool_size), _shape_arg(a.strides), _shape_arg(pad),
                      _shape_arg(a.dilation), _i(bool(a.ceil_mode))]
            if op == "relax.nn.max_pool2d":
                return _Rewrite(PREFIX + "max_pool2d", [x] + common + [layout])
            xs = _shape(x)
            hw = None if xs is None or len(xs) != 4 else (xs[2:] if layout == LAYOUT_NCHW else xs[1:3])
            if hw is not None and _ints(a.pool_size) == hw and not any(pad) and _ints(a.dilation) == [1, 1]:
                # one window over the whole image (light ResNet-50's AveragePool 7x7):
                # the global pool takes its input blocked, so the last conv needs no reorder
                return _Rewrite(PREFIX + "global_avg_pool2d", [x, layout])
            return _Rewrite(PREFIX + "avg_pool2d",
                         [x] + common + [_i(bool(a.count_include_pad)), layout])
        if op == "relax.nn.adaptive_avg_pool2d":
            a = expr.attrs
            layout = {"NCHW": LAYOUT_NCHW, "NHWC": LAYOUT_NHWC}.get(str(a.layout))
            if (a.output_size is not None and _ints(a.output_size) in ([1, 1], [1])
                    and layout is not None and str(a.out_layout) == str(a.layout)
                    and _f32(expr.args[0])):
                return _Rewrite(PREFIX + "global_avg_pool2d", [expr.args[0], layout])
            return None
        if op == "relax.mean":
            x = expr.args[0]
            xs = _shape(x)
            axes = sorted(int(v) % 4 for v in expr.attrs.axis) if expr.attrs.axis else None
            if xs is None or len(xs) != 4 or not _f32(x) or axes is None:
                return None
            if axes == [2, 3]:
                return _Rewrite(PREFIX + "global_avg_pool2d", [x, LAYOUT_NCHW])
            if axes == [1, 2]:
                return _Rewrite(PREFIX + "global_avg_pool2d", [x, LAYOUT_NHWC])
            return None
        if op == "relax.nn.softmax":
            x = expr.args[0]
            if not _f32(x) or _shape(x) is None:
                return None
            return _Rewrite(PREFIX + "softmax", [x, _i(int(expr.attrs.axis))])
        if op in ("relax.nn.layer_norm", "relax.nn.rms_norm"):
            x = expr.args[0]
            xs = _shape(x)
            axes = [int(v) % len(xs) for v in expr.attrs.axes] if xs else None
            if xs is None or axes != [len(xs) - 1] or not _f32(*expr.args):
                return None
            if any(_shape(e) != [xs[-1]] for e in expr.args[1:]):
                return None
            name = "layernorm" if op == "relax.nn.layer_norm" else "rmsnorm"
            return _Rewrite(PREFIX + name, list(expr.args) + [_f(float(expr.attrs.epsilon))])
        return None

    def match(self) -> dict:
        # Walk backwards so the longest chain wins; what it swallows is not
        # matched again (it becomes dead and DCE drops it).
        swallowed = self.swallowed
        for var in reversed(list(self.defs)):
            if var in swallowed:
                continue
            expr = self.defs[var]
            p = self.match_conv(var)
            if p is None:
                p = self.match_dense(var)
            if p is not None:
                swallowed.update(self.inner)
            else:
                p = self.match_single(expr)
            if p is not None:
                self.rewrites[var] = p
        return self.rewrites


def _block_layouts(m: _Matcher, rewrites: dict, swallowed: set) -> int:
    """Mark kernel-to-kernel NCHW tensors as blocked; returns how many."""
    uses: dict = {}

    def use(v):
        uses[v] = uses.get(v, 0) + 1

    for var, expr in m.defs.items():
        if var in swallowed:
            continue
        if var in rewrites:
            for a in rewrites[var].args:
                if isinstance(a, relax.Var):
                    use(a)
                elif isinstance(a, tuple) and len(a) == 3 and isinstance(a[1], relax.Var):
                    use(a[1])
        else:
            for v in relax.analysis.free_vars(expr):
                use(v)
    for v in m.outputs:
        use(v)

    def short(p):
        return p.kernel[len(PREFIX):]

    def groups_ok(p):
        if not short(p).startswith("conv2d"):
            return True
        g = _pv_int(p.args[KERNELS[short(p)].position("groups")])
        cin = _shape(p.args[0])[1]
        return g == 1 or g == cin  # plain or depthwise: both have NCHWc kernels
    n = 0
    for var, p in rewrites.items():
        k = short(p)
        if k not in ("conv2d", "conv2d_add", "conv2d_qw", "conv2d_add_qw", "max_pool2d") or not groups_ok(p):
            continue
        if p.args[_LAYOUT_ARG[k]] & 3 != LAYOUT_NCHW:
            continue
        shp = _shape(var)
        if shp is None or len(shp) != 4 or shp[1] % BLOCK_MULTIPLE:
            continue
        sites = []
        for cvar, cp in rewrites.items():
            ck = short(cp)
            for i, a in enumerate(cp.args):
                if isinstance(a, relax.Var) and a.same_as(var):
                    sites.append((cvar, ck, i))
        if not sites or len(sites) != uses.get(var, 0):
            continue  # something other than a kernel reads it
        if not all(i in BLOCKED_ARGS.get(ck, {}) and groups_ok(rewrites[cv])
                   and rewrites[cv].args[_LAYOUT_ARG[ck]] & 3 == LAYOUT_NCHW
                   for cv, ck, i in sites):
            continue
        p.args[_LAYOUT_ARG[k]] |= OUT_BLOCKED
        for cv, ck, i in sites:
            rewrites[cv].args[_LAYOUT_ARG[ck]] |= BLOCKED_ARGS[ck][i]
        n += 1
    return n


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod, rewrites):
        super().__init__(mod)
        self.rewrites = rewrites
        self.used: set[str] = set()

    def _arg(self, a):
        if isinstance(a, int):  # a layout code (kept raw so the NCHWc pass can edit it)
            return _i(a)
        if isinstance(a, tuple):  # a bias, normalised to shape (n,)
            if a[0] == "zeros":
                return relax.const(np.zeros(a[1], dtype=np.float32))
            _, expr, n = a
            v = self.visit_expr(expr)
            if _shape(expr) == [n]:
                return v
            return self.builder_.emit(relax.op.reshape(v, [n]))
        return self.visit_expr(a)

    def visit_var_binding_(self, binding):
        found = self.rewrites.get(binding.var)
        if found is None:
            return super().visit_var_binding_(binding)
        args = [self._arg(a) for a in found.args]
        call = relax.call_dps_packed(found.kernel, args, out_ty=binding.var.ty)
        new = self.builder_.emit(call, name_hint=binding.var.name)
        self.set_var_remap(binding.var, new)
        self.used.add(found.kernel)


def _rewrite_calls(mod: tvm.IRModule, blocked: bool) -> tuple[tvm.IRModule, set[str]]:
    used: set[str] = set()
    for gv, func in list(mod.functions.items()):
        if not isinstance(func, relax.Function):
            continue
        m = _Matcher(func)
        rewrites = m.match()
        if not rewrites:
            continue
        if blocked:
            _block_layouts(m, rewrites, m.swallowed)
        rw = _Rewriter(mod, rewrites)
        new_func = rw.visit_expr(func)
        mod[gv] = new_func
        used |= rw.used
    return mod, used


# ---------------------------------------------------------------- schedules

def _schedule_func(func: tirx.PrimFunc, cores: int, vec: int) -> tirx.PrimFunc:
    """Inline what can be inlined; parallel outer / vectorized inner on the rest."""
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    root = sch.get_sblock("root") if _has_root(sch) else None
    blocks = sch.get_child_blocks(root) if root is not None else []
    # inline producers into consumers (elementwise chains after FuseTIR)
    for blk in blocks[:-1]:
        try:
            sch.compute_inline(blk)
        except Exception:  # noqa: BLE001 - not inlinable: keep it
            pass
    for blk in sch.get_child_blocks(root) if root is not None else []:
        try:
            loops = sch.get_loops(blk)
            if not loops:
                continue
            kinds = [iv.iter_type for iv in sch.get(blk).iter_vars]
            spatial = all(k == 0 for k in kinds)  # 0 = data parallel
            if spatial and len(loops) == len(kinds):
                # Keep the innermost (contiguous) loop whole: fusing it with
                # the outer ones puts div/mod in every index and was 3x slower
                # than LLVM's own vectorisation of the plain nest.
                total = 1
                for lp in loops:
                    e = _extent(sch, lp)
                    total = total * e if e is not None and total is not None else None
                inner = loops[-1]
                ie = _extent(sch, inner)
                if ie is not None and ie % vec == 0 and ie > vec:
                    _, vi = sch.split(inner, [None, vec])
                    sch.vectorize(vi)
                if len(loops) > 1 and cores > 1 and total is not None and total >= _PAR_MIN:
                    outer = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
                    if (_extent(sch, outer) or 0) >= cores:
                        sch.parallel(outer)
            elif len(loops) == len(kinds):
                # reductions: parallelise the leading spatial loops only
                lead = []
                for lp, k in zip(loops, kinds):
                    if k != 0:
                        break
                    lead.append(lp)
                if lead and cores > 1:
                    f = sch.fuse(*lead) if len(lead) > 1 else lead[0]
                    e = _extent(sch, f)
                    if e is not None and e >= cores:
                        sch.parallel(f)
        except Exception as e:  # noqa: BLE001 - a failed schedule keeps the naive loop
            log.debug("schedule skipped: %s", e)
    return sch.mod["main"]


# below this many elements a parallel launch costs more than it saves
_PAR_MIN = 1 << 16


def _has_root(sch) -> bool:
    try:
        sch.get_sblock("root")
        return True
    except Exception:  # noqa: BLE001
        return False


def _extent(sch, loop) -> int | None:
    try:
        return int(sch.get(loop).extent)
    except (TypeError, ValueError):
        return None


def schedule_glue(mod: tvm.IRModule, target) -> tvm.IRModule:
    cores = target_cores(target)
    vec = 16  # float32 lanes of AVX-512; LLVM splits it for narrower vectors
    for gv, func in list(mod.functions.items()):
        if not isinstance(func, tirx.PrimFunc):
            continue
        if func.attrs is not None and func.attrs.get("tirx.is_scheduled", False):
            continue
        try:
            new = _schedule_func(func, cores, vec)
            mod[gv] = new.with_attr("tirx.is_scheduled", True)
        except Exception as e:  # noqa: BLE001
            log.debug("no schedule for %s: %s", gv, e)
    return mod


# ---------------------------------------------------------------- the hook

def rewrite(mod: tvm.IRModule, target=None, *, layout: str = "NCHW", offload: bool = True,
            blocked: bool = True, schedule: bool = True,
            fast_math: bool = False) -> tuple[tvm.IRModule, list[str]]:
    """Offload heavy operators to the kernel library; fuse and schedule the rest.

    Returns (module, imports): the rewritten module (still relax; compile it
    with ``tvm.compile(mod, target)``) and the sorted kernel names it calls.

    layout: "NCHW" keeps the graph's layout (best for the default onnxruntime
        kernel backend); "NHWC" moves convolutions to channels-last (best for
        the torch/oneDNN backend; adds a transpose at the graph's edges).
    offload: False keeps every operator in generated code (imports == []),
        still fused and scheduled when ``schedule`` is set.
    blocked: with layout="NCHW", tensors that only travel from kernel to
        kernel (conv -> conv/pool) stay in the backend's blocked layout
        (onnxruntime NCHWc): no reorder of the activations between them.
    schedule: fuse and schedule the generated code for ``target``'s cores.
    fast_math: exp/tanh/erf (and any softmax left in generated code) use TVM's
        fast approximations: exp <= 4.1e-6 relative over [-87, 88], tanh
        <= 3.2e-7 and erf <= 3.8e-7 absolute (measured; docs/kernels.md).
        Off by default: with softmax in the kernel library it bought nothing
        measurable here (exp+sum over 64x4096 was slower with it).
    """
    if not isinstance(mod, tvm.IRModule):
        raise RewriteError(f"expected a tvm.IRModule, got {type(mod).__name__}")
    if layout not in ("NCHW", "NHWC"):
        raise RewriteError(f"layout must be NCHW or NHWC, got {layout!r}")
    used: set[str] = set()
    passes = [relax.transform.FoldConstant()]
    if offload and layout == "NHWC":
        passes.append(relax.transform.ConvertLayout({"relax.nn.conv2d": ["NHWC", "OIHW"]}))
        passes.append(relax.transform.FoldConstant())
    mod = tvm.transform.Sequential(passes)(mod)
    if offload:
        mod, used = _rewrite_calls(mod, blocked and layout == "NCHW")
        mod = relax.transform.DeadCodeElimination()(mod)
        mod = relax.transform.FoldConstant()(mod)
    if fast_math:
        mod = relax.transform.FastMathTransform()(mod)
    if schedule:
        mod = lower_and_schedule(mod, target)
    return mod, sorted(used)


def lower_and_schedule(mod: tvm.IRModule, target) -> tvm.IRModule:
    """Legalize, fuse (FuseOps/FuseTIR) and schedule the generated glue."""
    seq = tvm.transform.Sequential([
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        relax.transform.DeadCodeElimination(),
    ])
    mod = seq(mod)
    if target is not None:
        mod = schedule_glue(mod, target)
    return mod
