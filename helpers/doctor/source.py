"""What the user's source files and stacks say: rank-dependent branches, loops, stack frames.

The only part of the doctor that reads files besides the run folder: the user's scripts, parsed
once each (``ast``) and cached for the process, and faulthandler's stack dumps (text).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

from helpers.sites import is_user_code

_RANK_TEST = re.compile(r"is_main_process|is_local_main_process|is_last_process|process_index|"
                        r"local_process_index|\b(local_|global_|node_)?rank\b|get_rank|RANK")
_trees: dict[str, Any] = {}
_rank_names_of: dict[str, dict] = {}  # a file's names of the rank, by scope (``_rank_names``)


def _tree(filename: str | None):
    """A user's file parsed once per process, as (its tree, its lines); None when unreadable."""
    if not filename:
        return None
    if filename not in _trees:
        try:
            source = Path(filename).read_text()
            _trees[filename] = (ast.parse(source), source.splitlines())
        except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):  # RecursionError: nested
            _trees[filename] = None  # past what ast.parse builds (a chain of thousands of elifs)
    return _trees[filename]


def mentions_rank(text: str) -> bool:
    """Does an expression's text name the rank (is_main_process, get_rank(), RANK, process_index...)?"""
    return bool(_RANK_TEST.search(text))


def rank_conditional(filename: str | None, line: int | None) -> bool:
    """Is ``line`` inside an ``if`` whose test depends on the rank (is_main_process, rank == 0...)?"""
    return rank_condition(filename, line) is not None


def rank_condition(filename: str | None, line: int | None) -> tuple[int, str, str] | None:
    """The innermost ``if`` around ``line`` whose test depends on the rank, as (its line, its test's
    text cut after ``_EXIT_TEST_CHARS``, where ``line`` is: "if", "elif" (its test an ``elif``'s) or
    "else"); None when there is none."""
    parsed = _tree(filename)
    if parsed is None or line is None:
        return None
    if filename not in _rank_names_of:
        _rank_names_of[filename] = _rank_names(parsed[0])
    derived = _rank_names_of[filename]
    for node, found in _conditions_around(parsed, line):
        if _against_minus_one(node.test):  # 'if local_rank != -1:': distributed or not, on every rank
            continue
        if _RANK_TEST.search(_without_minus_one(node.test)) \
                or _names_in(node.test) & _visible(derived, node.lineno):
            return found
    return _rank_decorator(parsed[0], line)


_ON_PROCESS = re.compile(r"\bon_(main|local_main|last)_process\b|\bon_(local_)?process\(")  # accelerate's


def _rank_decorator(tree: ast.AST, line: int) -> tuple[int, str, str] | None:
    """A decorator that runs the function around ``line`` on some ranks alone (accelerate's
    ``@accelerator.on_main_process``, ``on_local_main_process``, ``on_last_process``,
    ``on_process(process_index=1)``), as (its line, its text, "@"); None when there is none."""
    functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and node.lineno <= line <= (node.end_lineno or 0)]
    functions.sort(key=lambda node: node.lineno, reverse=True)  # the innermost first
    for function in functions:
        for decorator in function.decorator_list:
            text = _text(decorator)
            if _ON_PROCESS.search(text):
                return decorator.lineno, _cut(text), "@"
    return None


def enclosing_condition(filename: str | None, line: int | None) -> tuple[int, str, str] | None:
    """The innermost ``if`` around ``line``, whatever its test, as ``rank_condition`` gives it."""
    parsed = _tree(filename)
    if parsed is None or line is None:
        return None
    return next((found for _node, found in _conditions_around(parsed, line)), None)


def opposite_branches(filename: str | None, line: int, other: int) -> bool:
    """Are two lines in different branches of one ``if``, so that either runs, never both (one call
    site written once per branch)? Its body and its else (or elif); or, for an ``if`` whose body
    ends in a return, raise, break or continue, its body and the statements after it."""
    parsed = _tree(filename)
    if parsed is None:
        return False
    for block in _statement_lists(parsed[0]):
        for index, node in enumerate(block):
            if not isinstance(node, ast.If):
                continue
            rest = node.orelse or (block[index + 1:] if isinstance(node.body[-1], _LEAVES) else [])
            if rest and ((_within(node.body, line) and _within(rest, other))
                         or (_within(rest, line) and _within(node.body, other))):
                return True
    return False


_LEAVES = (ast.Return, ast.Raise, ast.Break, ast.Continue)  # a block's statements after it never run


def _statement_lists(tree: ast.AST):
    """Every list of statements in ``tree`` (bodies, else blocks, handlers')."""
    for node in ast.walk(tree):
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                yield block


def _within(statements: list[ast.stmt], number: int) -> bool:
    return statements[0].lineno <= number <= (statements[-1].end_lineno or 0)


def _conditions_around(parsed: tuple[ast.AST, list[str]], line: int):
    """The ``if`` statements whose bodies hold ``line``, innermost first: (node, (its line, its
    test's text cut, "if", "elif" or "else"))."""
    around = sorted((node for node in ast.walk(parsed[0])
                     if isinstance(node, ast.If) and node.lineno < line <= (node.end_lineno or 0)),
                    key=lambda node: node.lineno, reverse=True)
    for node in around:
        in_else = bool(node.orelse) and line >= node.orelse[0].lineno
        header = parsed[1][node.lineno - 1].lstrip() if node.lineno else ""
        yield node, (node.lineno, _cut(_text(node.test)),
                     "else" if in_else else "elif" if header.startswith("elif") else "if")


def _cut(text: str) -> str:
    return text if len(text) <= _EXIT_TEST_CHARS else text[:_EXIT_TEST_CHARS - 3] + "..."


def _text(node: ast.AST) -> str:
    """An expression's source, rebuilt (``ast.get_source_segment`` splits the whole file per call)."""
    try:
        return ast.unparse(node)
    except (RecursionError, ValueError):
        return ""


def _against_minus_one(test: ast.AST) -> bool:
    """Is ``test`` a comparison with -1 (``local_rank != -1``): the old 'launched distributed at all'
    check, alike on every rank?"""
    return isinstance(test, ast.Compare) and any(
        isinstance(side, ast.UnaryOp) and isinstance(side.op, ast.USub)
        and isinstance(side.operand, ast.Constant) and side.operand.value == 1 for side in test.comparators)


def _without_minus_one(test: ast.AST) -> str:
    """A test's text but its comparisons with -1 (``ddp or local_rank != -1``: alike on every rank)."""
    if isinstance(test, ast.BoolOp):
        return " ".join(_without_minus_one(value) for value in test.values)
    return "" if _against_minus_one(test) else _text(test)


Scope = tuple[int, int] | None  # a function's first and last line; None: the module (and attributes)


def _rank_names(tree: ast.AST) -> dict[Scope, set[str]]:
    """Names the script gives the rank or a number or truth it computes from it (``r =
    dist.get_rank()``, ``main = accelerator.is_main_process``, ``first = r == 0``;
    ``_from_rank``), by the function they are set in;
    an attribute (``self.me = ...``) by its name, for the whole file: a test on one of them is a
    test on the rank. Of ``rank, world = get_rank(), get_world_size()`` only the name whose own
    value says so."""
    names: dict[Scope, set[str]] = {None: set()}
    try:
        assignments = list(_assignments(tree, None))
    except RecursionError:  # nested past the interpreter's limit: no names of the rank told
        return names
    grown = True
    while grown:  # a name from a name from the rank, to any depth
        grown = False
        for scope, target, value in assignments:
            try:
                if not _from_rank(value, _visible(names, value.lineno)):
                    continue
            except RecursionError:  # an expression too long to walk (generated code)
                continue
            for name, where in _targets(target, scope):
                if name not in names.setdefault(where, set()):
                    names[where].add(name)
                    grown = True
    return names


def _from_rank(node: ast.AST, names: set[str]) -> bool:
    """Is an assigned value the rank, or a number or truth computed from it (``r == 0``,
    ``int(os.environ["LOCAL_RANK"])``, ``not is_main``)? Not a value merely built with it
    (``torch.device("cuda", local_rank)``, an f-string), nor a comparison with -1 (``local_rank !=
    -1``, alike on every rank): a test on those is not a test on the rank."""
    if isinstance(node, ast.Name):
        return node.id in names or bool(_RANK_TEST.search(node.id))
    if isinstance(node, (ast.Attribute, ast.Subscript)):
        named = isinstance(node, ast.Attribute) and node.attr in names
        return named or bool(_RANK_TEST.search(_text(node)))
    if isinstance(node, ast.Call):
        func = _text(node.func)
        return bool(_RANK_TEST.search(func)) or _env_rank(node, func) or (
            func in ("int", "bool") and any(_from_rank(arg, names) for arg in node.args))
    if isinstance(node, ast.Compare) and _against_minus_one(node):
        return False
    if isinstance(node, (ast.Compare, ast.BoolOp, ast.UnaryOp, ast.BinOp)):
        parts = [part for part in ast.iter_child_nodes(node) if isinstance(part, ast.expr)]
        return any(_from_rank(part, names) for part in parts)
    return False


# the launchers' variables of a rank's place (torchrun's, accelerate's, Slurm's, Open MPI's)
_RANK_VARIABLES = {"RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK", "ROLE_RANK", "SLURM_PROCID",
                   "SLURM_LOCALID", "SLURM_NODEID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"}


def _env_rank(node: ast.Call, func: str) -> bool:
    """``os.environ.get("LOCAL_RANK", "0")``, ``os.getenv("RANK")``: a launcher's rank variable
    (not a setting that merely ends in RANK: LORA_RANK)."""
    first = node.args[0] if node.args else None
    return (func.endswith(("environ.get", "getenv")) and isinstance(first, ast.Constant)
            and first.value in _RANK_VARIABLES)


def _assignments(node: ast.AST, scope: Scope):
    """(scope, target, value) of each assignment under ``node``, a tuple unpacked item by item."""
    for child in ast.iter_child_nodes(node):
        inner = scope
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inner = (child.lineno, child.end_lineno or child.lineno)
        targets, value = [], None
        if isinstance(child, ast.Assign):
            targets, value = child.targets, child.value
        elif isinstance(child, (ast.AnnAssign, ast.NamedExpr)) and child.value is not None:
            targets, value = [child.target], child.value
        for target in targets:
            paired = isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and \
                len(target.elts) == len(value.elts)
            for one, its in zip(target.elts, value.elts, strict=True) if paired else [(target, value)]:
                yield scope, one, its
        yield from _assignments(child, inner)


_ROOT_KEYWORDS = ("src", "dst", "root", "from_process", "group_src", "group_dst")
_ROOTED = ("broadcast", "reduce", "broadcast_object_list")  # calls whose second argument is the root


def root_argument(filename: str | None, line: int | None) -> str | None:
    """The text of the root passed by the call at ``line`` (``src=owner``, ``from_process=owner``,
    a broadcast's second argument); None when there is none to read."""
    parsed = _tree(filename)
    if parsed is None or line is None:
        return None
    for node in ast.walk(parsed[0]):
        if isinstance(node, ast.Call) and node.lineno <= line <= (node.end_lineno or node.lineno):
            for keyword in node.keywords:
                if keyword.arg in _ROOT_KEYWORDS:
                    return _text(keyword.value)
            if len(node.args) >= 2 and _called_name(node.func) in _ROOTED:
                return _text(node.args[1])
    return None


def values_read(filename: str | None, line: int | None, test: str) -> list[str]:
    """What gives the names in a condition's text (``test``, as at ``line``) their values, in the
    function around that line: each assignment's value (``+=`` too) and the test of the innermost
    ``if`` around it. ``bad_epochs >= patience`` reads 'val_loss < best - 1e-3' through
    ``bad_epochs += 1`` in that ``if``'s else: a count each rank keeps of its own loss."""
    parsed = _tree(filename)
    try:
        names = {node.id for node in ast.walk(ast.parse(test, mode="eval")) if isinstance(node, ast.Name)}
    except SyntaxError:  # 'except ValueError', not an expression
        return []
    if parsed is None or line is None or not names:
        return []
    scope = _innermost(filename, line, (ast.FunctionDef, ast.AsyncFunctionDef)) or parsed[0]
    texts = []
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None:
            targets = [node.target]
        else:
            continue
        if names & {name for target in targets for name, _scope in _targets(target, None)}:
            texts.append(_text(node.value))
            condition = enclosing_condition(filename, node.lineno)
            if condition is not None:
                texts.append(condition[1])
    return texts


def _targets(target: ast.AST, scope: Scope) -> list[tuple[str, Scope]]:
    """The names an assignment target sets, each with where it is seen: a plain name in its
    function, an attribute's name everywhere."""
    if isinstance(target, ast.Name):
        return [(target.id, scope)]
    if isinstance(target, ast.Attribute):
        return [(target.attr, None)]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [found for item in target.elts for found in _targets(item, scope)]
    return []


def _visible(names: dict[Scope, set[str]], line: int) -> set[str]:
    """The rank's names seen at ``line``: the file's, and those of the functions around it."""
    seen = set(names.get(None, ()))
    for scope, found in names.items():
        if scope is not None and scope[0] <= line <= scope[1]:
            seen |= found
    return seen


def _names_in(node: ast.AST) -> set[str]:
    """The plain names and attribute names an expression reads."""
    return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
            if isinstance(n, (ast.Name, ast.Attribute))}


def enclosing_loop(filename: str | None, line: int | None) -> int | None:
    """The header line of the innermost for/while loop around ``line`` (None outside loops)."""
    loop = _innermost(filename, line, (ast.For, ast.While))
    return loop.lineno if loop is not None else None


def _innermost(filename: str | None, line: int | None, kinds: tuple[type, ...]) -> Any:
    """The innermost node of one of ``kinds`` whose lines hold ``line`` (None when there is none)."""
    parsed = _tree(filename)
    if parsed is None or line is None:
        return None
    around = [node for node in ast.walk(parsed[0])
              if isinstance(node, kinds) and node.lineno <= line <= (node.end_lineno or 0)]
    return max(around, key=lambda node: node.lineno, default=None)


def exits_with_block(filename: str | None, line: int | None, called: tuple[str, int] | None,
                     other: int | None) -> bool:
    """Is ``line`` the header of a ``with`` statement whose block holds line ``other``, and the frame it
    ``called`` (file, line) in its context manager's ``__exit__``: a call that runs after the block,
    though its line comes before it?"""
    parsed = _tree(filename)
    if parsed is None or line is None or other is None or called is None:
        return False
    block = next((node for node in ast.walk(parsed[0]) if isinstance(node, (ast.With, ast.AsyncWith))
                  and node.lineno == line and node.body[0].lineno <= other <= (node.end_lineno or 0)), None)
    function = _innermost(called[0], called[1], (ast.FunctionDef, ast.AsyncFunctionDef))
    return block is not None and function is not None and function.name in ("__exit__", "__aexit__")


_CACHES = ("lru_cache", "cache", "cached_property")  # functools' decorators that run a body once per key


def cached_function(filename: str | None, line: int | None) -> tuple[str, int, str] | None:
    """The function around ``line`` when a functools cache decorates it ('@functools.lru_cache',
    '@cache', '@cached_property'), as (its name, its decorator's line, the decorator's name); None
    otherwise. Its body runs only on a cache miss."""
    function = _innermost(filename, line, (ast.FunctionDef, ast.AsyncFunctionDef))
    for decorator in function.decorator_list if function is not None else []:
        name = _called_name(decorator.func if isinstance(decorator, ast.Call) else decorator)
        if name in _CACHES:
            return function.name, decorator.lineno, name
    return None


def in_loop_body(filename: str | None, header: int | None, line: int | None) -> bool:
    """Is ``line`` in the body of the loop whose header is at ``header``, run by its turns: not in
    its ``else`` block, nor in a function or class defined inside it?"""
    parsed = _tree(filename)
    if parsed is None or header is None or line is None:
        return False
    loop = next((node for node in ast.walk(parsed[0]) if isinstance(node, _LOOPS) and node.lineno == header),
                None)
    if loop is None or not _within(loop.body, line):
        return False
    return not any(isinstance(node, _SCOPES) and node.lineno <= line <= (node.end_lineno or 0)
                   for statement in loop.body for node in ast.walk(statement))


def call_chain(filename: str | None, line: int | None) -> list[int]:
    """The lines that lead to ``line`` from the file's top level, outermost first, ``line`` last,
    read from the source where each function on the way is called from one line of the file alone
    (a script's ``validate`` called once in ``main``, ``main`` once under ``if __name__ ==
    "__main__":``): the stack of a rank that died before it was read. [] when a function on the way
    is called from no line or from several, or named otherwise (a callback), or the file is unread."""
    parsed = _tree(filename)
    if parsed is None or line is None:
        return []
    chain = [line]
    for _ in range(_CHAIN_DEPTH):
        scope = _innermost(filename, chain[0], (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if scope is None:
            return chain
        if isinstance(scope, ast.Lambda):
            return []
        calls, named = [], 0
        for node in ast.walk(parsed[0]):
            if isinstance(node, ast.Call) and _called_name(node.func) == scope.name:
                calls.append(node.lineno)
            elif isinstance(node, ast.Name) and node.id == scope.name:
                named += 1
        if len(calls) != 1 or named > len(calls) or scope.lineno <= calls[0] <= (scope.end_lineno or 0):
            return []  # several callers, a reference passed on, or a call from within (recursion)
        chain.insert(0, calls[0])
    return []


_CHAIN_DEPTH = 16  # functions followed up from a line by ``call_chain``


def _called_name(func: ast.AST) -> str | None:
    """A called (or decorating) name's last part: ``validate``, ``accelerator.reduce`` -> reduce."""
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else None


def enclosing_function(filename: str | None, line: int | None) -> int | None:
    """The header line of the innermost function (or lambda) around ``line``: 0 at module level,
    None when the file cannot be read."""
    if _tree(filename) is None or line is None:
        return None
    scope = _innermost(filename, line, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
    return scope.lineno if scope is not None else 0


def loop_left(filename: str | None, inside: int | None, after: int | None) -> int | None:
    """The header line of the loop around line ``inside`` that line ``after`` lies past the end of,
    in the same function (None when there is none): a rank at ``after`` has left the loop that a rank
    at ``inside`` is still in. Of nested loops it has left, the innermost (uneven batches run out in
    the batch loop, every epoch alike), unless an outer one holds a break or return of its own (an
    early stop leaves the epoch loop)."""
    loops = _loops_around(filename, inside)
    if not loops or after is None or after <= (loops[0].end_lineno or after):
        return None
    scope = _innermost(filename, loops[0].lineno, (ast.FunctionDef, ast.AsyncFunctionDef))
    if scope is not None and after > (scope.end_lineno or 0):
        return None
    return _loop_left_of(filename, [loop for loop in loops if after > (loop.end_lineno or after)], inside)


def loop_returned_from(filename: str | None, inside: int | None) -> int | None:
    """The header line of the loop around line ``inside`` that a rank has left by returning from
    the function that holds both (chosen among nested loops as ``loop_left`` does); None when no
    loop of that function holds the line."""
    loops = _loops_around(filename, inside)
    return _loop_left_of(filename, loops, inside) if loops and inside is not None else None


def _loop_left_of(filename: str | None, left: list[Any], inside: int) -> int:
    """Of the nested loops a rank has left (innermost first), the one to name: the innermost (uneven
    batches run out in the batch loop, every epoch alike), unless an outer one holds a break or
    return of its own (an early stop leaves the epoch loop)."""
    for loop in reversed(left[1:]):
        exits = loop_exits(filename, loop.lineno, inside)
        if any(keyword in ("break", "return") for keyword, _line, _test in exits):
            return loop.lineno
    return left[0].lineno


def swallowing_handler(filename: str | None, line: int | None) -> tuple[int, str] | None:
    """The ``except`` clause (its line, 'except ValueError:') of the innermost ``try`` whose body
    holds ``line`` when that clause re-raises nothing (``except Exception: pass``): an error raised
    on one rank before the call there, in the try, skips the call on that rank alone, silently."""
    parsed = _tree(filename)
    if parsed is None or line is None:
        return None
    tries = [node for node in ast.walk(parsed[0]) if isinstance(node, ast.Try) and node.handlers
             and node.body and node.body[0].lineno <= line <= (node.body[-1].end_lineno or 0)]
    if not tries:  # (a try with only a finally is passed over for the one around it)
        return None
    return _swallowing(max(tries, key=lambda node: node.lineno))


def swallowing_finally(filename: str | None, line: int | None) -> tuple[int, str] | None:
    """The ``except`` clause (its line and text) that re-raises nothing, of the innermost ``try``
    whose ``finally`` holds ``line``: an error raised in that try on one rank is caught, and the
    rank goes through the finally (a destroy_process_group there) and on as if its work were done."""
    parsed = _tree(filename)
    if parsed is None or line is None:
        return None
    tries = [node for node in ast.walk(parsed[0]) if isinstance(node, ast.Try) and node.handlers
             and node.finalbody and node.finalbody[0].lineno <= line <= (node.finalbody[-1].end_lineno or 0)]
    return _swallowing(max(tries, key=lambda node: node.lineno)) if tries else None


def _swallowing(node: ast.Try) -> tuple[int, str] | None:
    """A try's first handler that catches any error and re-raises nothing: its line and text."""
    for handler in node.handlers:
        if _catches_errors(handler) and not _leaves(handler):
            caught = f" {ast.unparse(handler.type)}" if handler.type is not None else ""
            return handler.lineno, f"except{caught}{f' as {handler.name}' if handler.name else ''}:"
    return None


_CATCH_ALL = {"Exception", "BaseException"}
_ENDS_PROCESS = {"exit", "_exit", "quit", "abort"}  # sys.exit, os._exit, exit(), os.abort


def _catches_errors(handler: ast.ExceptHandler) -> bool:
    """Does it catch an error a computation raises: any (a bare except, Exception, BaseException),
    or one named as an error ('except ZeroDivisionError:' around a metric's division, KeyError,
    ValueError; a tuple with one)? Not StopIteration or KeyboardInterrupt, which end a loop or the
    run on purpose."""
    if handler.type is None:
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    names = [_text(each).rsplit(".", 1)[-1] for each in types]
    return any(name in _CATCH_ALL or name.endswith("Error") for name in names)


def _leaves(handler: ast.ExceptHandler) -> bool:
    """Does the handler re-raise or end the process (a raise, sys.exit(), os._exit()), its own
    statements read, not those of a function or class defined in it?"""
    nodes = list(handler.body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, ast.Raise):
            return True
        if isinstance(node, ast.Call) and _text(node.func).rsplit(".", 1)[-1] in _ENDS_PROCESS:
            return True
        if not isinstance(node, _SCOPES):
            nodes.extend(ast.iter_child_nodes(node))
    return False


def share_a_loop(filename: str | None, line: int | None, other: int | None) -> bool:
    """Do ``line`` and ``other`` lie in one loop of the same function (a rank at one may be a turn
    ahead of a rank at the other)?"""
    return other is not None and any(loop.lineno <= other <= (loop.end_lineno or 0)
                                     for loop in _loops_around(filename, line))


def _loops_around(filename: str | None, line: int | None) -> list[Any]:
    """The loops whose lines hold ``line``, innermost first, within its innermost function."""
    parsed = _tree(filename)
    if parsed is None or line is None:
        return []
    scope = _innermost(filename, line, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
    start = scope.lineno if scope is not None else 0
    around = [node for node in ast.walk(parsed[0]) if isinstance(node, (ast.For, ast.While))
              and start < node.lineno <= line <= (node.end_lineno or 0)]
    return sorted(around, key=lambda node: node.lineno, reverse=True)


_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_EXIT_TEST_CHARS = 60  # a condition's text, cut after this many characters


def loop_exits(filename: str | None, loop_line: int | None,
               call_line: int | None) -> list[tuple[str, int, str]]:
    """What can end a turn of the loop whose header is at ``loop_line`` before the call at
    ``call_line``, as ``(keyword, line, condition)``: a ``while`` loop's own test (``"while"``),
    each ``continue`` above that line, each ``break`` and ``return`` in the loop (nested loops and
    functions have their own breaks and continues; a return there leaves this loop too), with the
    test of the innermost ``if`` around it ('' when none; ``not (...)`` in its ``else``; ``except
    ValueError`` in a handler). Taken on some ranks alone (a NaN loss, an empty batch, a flag one
    rank set), each leaves them fewer collectives than the others; [] past the interpreter's
    recursion limit (a chain of thousands of elifs)."""
    parsed = _tree(filename)
    if parsed is None or loop_line is None or call_line is None:
        return []
    loops = [node for node in ast.walk(parsed[0])
             if isinstance(node, _LOOPS) and node.lineno == loop_line]
    if not loops:
        return []
    loop = loops[0]
    found: list[tuple[str, int, str]] = []
    if isinstance(loop, ast.While) and not (isinstance(loop.test, ast.Constant) and loop.test.value):
        found.append(("while", loop.lineno, _cut(_text(loop.test))))  # its own test ends it too
    try:
        for statement in loop.body:
            _exits_in(statement, "", call_line, found, True)
    except RecursionError:
        return []
    return sorted(found, key=lambda exit_: exit_[1])


def returns_before(filename: str | None, line: int | None) -> list[tuple[int, str]]:
    """The ``return`` statements above ``line`` in its innermost function, each with the test of
    the innermost ``if`` around it (as ``loop_exits`` gives them): a function called in a loop that
    can leave before the call at ``line`` on some ranks alone."""
    function = _innermost(filename, line, (ast.FunctionDef, ast.AsyncFunctionDef))
    if function is None or line is None:
        return []
    found: list[tuple[str, int, str]] = []
    try:
        for statement in function.body:
            _exits_in(statement, "", line, found, False)
    except RecursionError:
        return []
    return sorted((at, test) for keyword, at, test in found if keyword == "return" and at < line)


def _exits_in(node: ast.AST, test: str, call_line: int, found: list[tuple[str, int, str]], own: bool) -> None:
    """``loop_exits``' walk; ``own``: still in the loop itself (not in a loop nested in it)."""
    if isinstance(node, _SCOPES):
        return
    if isinstance(node, ast.Return) or (own and (
            isinstance(node, ast.Break) or (isinstance(node, ast.Continue) and node.lineno < call_line))):
        keyword = {ast.Break: "break", ast.Return: "return", ast.Continue: "continue"}[type(node)]
        found.append((keyword, node.lineno, test))
        return
    if isinstance(node, ast.If):
        text = _cut(_text(node.test))
        for child in node.body:
            _exits_in(child, text, call_line, found, own)
        for child in node.orelse:
            _exits_in(child, f"not ({text})" if text else "", call_line, found, own)
        return
    if isinstance(node, ast.ExceptHandler):  # taken when the body raised
        test = f"except {_text(node.type)}" if node.type is not None else "except"
    own = own and not isinstance(node, _LOOPS)
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.stmt, ast.ExceptHandler, ast.match_case)):
            _exits_in(child, test, call_line, found, own)


_GOES_FIRST = re.compile(r"(main|local_main)_process_first")  # accelerate's and transformers' context


def goes_first_block(filename: str | None, line: int | None) -> int | None:
    """The header line of the innermost ``with ...main_process_first():`` block (accelerate's
    ``main_process_first`` or ``local_main_process_first``, transformers' ``TrainingArguments.
    main_process_first``) whose header or body holds ``line``; None when there is none. Its header
    is where the ranks that go second wait in a barrier while the main process runs the body."""
    parsed = _tree(filename)
    if parsed is None or line is None:
        return None
    blocks = [node for node in ast.walk(parsed[0])
              if isinstance(node, (ast.With, ast.AsyncWith)) and node.lineno <= line <= (node.end_lineno or 0)
              and any(_GOES_FIRST.search(_text(item.context_expr)) for item in node.items)]
    return max((node.lineno for node in blocks), default=None)


def lock_taken_at(filename: str | None, line: int | None) -> str | None:
    """The lock a line takes: 'self._lock' of 'with self._lock:' or 'self._lock.acquire()'; None
    when the line takes none (or cannot be read)."""
    parsed = _tree(filename)
    if parsed is None or line is None:
        return None
    for node in ast.walk(parsed[0]):
        if getattr(node, "lineno", None) != line:
            continue
        if isinstance(node, (ast.With, ast.AsyncWith)):
            return _text(node.items[0].context_expr)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "acquire":
            return _text(node.func.value)
    return None


def holding(filename: str | None, line: int | None, lock: str) -> int | None:
    """The header line of the innermost ``with <lock>:`` block (the same text) whose body holds
    ``line``: a frame there holds that lock. None when there is none."""
    parsed = _tree(filename)
    if parsed is None or line is None:
        return None
    blocks = [node.lineno for node in ast.walk(parsed[0]) if isinstance(node, (ast.With, ast.AsyncWith))
              and node.body and node.body[0].lineno <= line <= (node.end_lineno or 0)
              and any(_text(item.context_expr) == lock for item in node.items)]
    return max(blocks, default=None)


def source_line(frame: dict[str, Any]) -> str:
    """The text of a stack frame's line in the user's file ('' when unreadable)."""
    parsed = _tree(frame.get("file"))
    if parsed is None or not frame.get("line"):
        return ""
    lines = parsed[1]
    index = frame["line"] - 1
    return lines[index] if 0 <= index < len(lines) else ""


_FH_THREAD = re.compile(r"^((Current thread|Thread) 0x[0-9a-f]+ .*|Stack )\(most recent call first\):?$",
                        re.MULTILINE)
_FH_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)', re.MULTILINE)


def faulthandler_stack(text: str) -> list[dict[str, Any]]:
    """The main thread's frames (outermost first) from faulthandler's last dump in ``text``."""
    mains = [frames for _thread, main, frames in faulthandler_threads(text) if main]
    return mains[-1] if mains else []


def faulthandler_threads(text: str) -> list[tuple[str, bool, list[dict[str, Any]]]]:
    """Each thread in faulthandler's dumps in ``text``, in order: (its id, as Python's
    ``threading.get_ident()`` and the Flight Recorder write it, or "?"; whether it is the main
    thread, the one running a module's code (a ``<module>`` frame); its frames, outermost first)."""
    heads = list(_FH_THREAD.finditer(text or ""))
    if not heads:  # not a dump (cut off): no frames
        return []
    ends = [head.start() for head in heads[1:]] + [len(text)]
    threads = []
    for head, end in zip(heads, ends, strict=True):
        frames = [{"file": m["file"], "line": int(m["line"]), "func": m["func"],
                   "user": is_user_code(m["file"]), "where": f"{Path(m['file']).name}:{m['line']}"}
                  for m in _FH_FRAME.finditer(text, head.end(), end)][::-1]
        ident = re.search(r"0x[0-9a-f]+", head.group())
        main = any(frame["func"] == "<module>" for frame in frames)
        threads.append((str(int(ident.group(), 16)) if ident else "?", main, frames))
    return threads
