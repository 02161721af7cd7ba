"""A submission that hands in the library's own answer scores nothing.

Labs import library code that is an exercise's answer (the lab needs it later, or compares against it):
``assign_buckets`` in lab 03, the ring all-reduce in ``distlab.collectives``, the Gopher rules in lab 10. An
exercise lists those functions as its ``references`` (dotted paths), and :func:`reference_use` looks at what the
student hands in before the checker runs: the reference itself, a function with the reference's code, or code
that calls it. "Calls" is read from the bytecode, not by running anything: every name a function (its nested
functions and lambdas, and the notebook's own functions it uses, transitively) loads, resolved through its
globals, its closure and the attributes of the modules it reaches, as ``distlab.collectives.ring_all_reduce``
is reached through ``distlab``. A student's own function that happens to share the reference's name is their
own object, so it is not flagged.
"""

from __future__ import annotations

import importlib
import inspect
import types

__all__ = ["reference_use"]


def _resolve(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _codes(code: types.CodeType):
    """A code object and every code object nested in it (inner functions, lambdas, comprehensions)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _functions(obj) -> list:
    """The plain functions a submission consists of: itself, or the methods of a class and of its bases written
    beside it (the notebook's); a library base class is scaffolding, its methods are not the student's."""
    if inspect.isclass(obj):
        found = []
        for cls in obj.__mro__:
            if cls.__module__ != obj.__module__:
                continue
            for member in vars(cls).values():
                member = getattr(member, "__func__", member)  # staticmethod, classmethod
                member = inspect.unwrap(member) if callable(member) else member
                if isinstance(member, property):
                    found += [f for f in (member.fget, member.fset) if f is not None]
                elif inspect.isfunction(member):
                    found.append(member)
        return found
    obj = inspect.unwrap(getattr(obj, "__func__", obj))  # a bound method; a decorated function's own body
    return [obj] if inspect.isfunction(obj) else []


def _reached(function) -> list:
    """Every object ``function``'s code can load by name: globals, closure cells, and attributes (named in its
    code) of the modules among them, followed module by module."""
    names = {name for code in _codes(function.__code__) for name in code.co_names}
    objects = [function.__globals__[n] for n in names if n in function.__globals__]
    objects += [cell.cell_contents for cell in function.__closure__ or () if _filled(cell)]
    modules = [o for o in objects if isinstance(o, types.ModuleType)]
    seen = {id(m) for m in modules}
    while modules:
        module = modules.pop()
        for name in names:
            value = getattr(module, name, None)
            if value is None:
                continue
            objects.append(value)
            if isinstance(value, types.ModuleType) and id(value) not in seen:
                seen.add(id(value))
                modules.append(value)
    return objects


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018  an empty cell raises ValueError
    except ValueError:
        return False
    return True


def reference_use(student_code: tuple, references: tuple[str, ...]) -> str | None:
    """Why this submission is the library's answer (one line naming the reference), or None.

    Under ``distlab grade`` the submission is held apart from the grader (:mod:`distlab.grading.isolation`): the
    question is then asked where its objects are, and its answer (a line, or None) is all that comes back."""
    if not references:
        return None
    for code in student_code:
        if hasattr(code, "run_beside"):
            return code.run_beside(reference_use, tuple(student_code), tuple(references))
    answers = {}
    for dotted in references:
        answer = _resolve(dotted)
        answers[id(answer)] = dotted
        # The body's code, not a decorator's: every ``@torch.no_grad()`` function shares torch's wrapper code.
        answers[id(getattr(inspect.unwrap(answer), "__code__", answer))] = dotted
    pending = [f for obj in student_code for f in _functions(obj)]
    for obj in student_code:
        if id(obj) in answers:
            return f"this is {answers[id(obj)]}, the library's own answer"
        for base in obj.__mro__[1:] if inspect.isclass(obj) else ():
            if id(base) in answers:
                return f"{obj.__qualname__} subclasses {answers[id(base)]}, the library's own answer"
    own_module = {f.__module__ for f in pending}
    seen: set[int] = set()
    while pending:
        function = pending.pop()
        if id(function.__code__) in seen:
            continue
        seen.add(id(function.__code__))
        if id(function.__code__) in answers:
            return f"{function.__qualname__} is {answers[id(function.__code__)]}, the library's own answer"
        for value in _reached(function):
            if id(value) in answers or callable(value) and id(inspect.unwrap(value)) in answers:
                return f"{function.__qualname__} calls {answers[id(value)]}, the library's own answer"
            if (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__ in own_module:
                pending += _functions(value)  # the notebook's own helpers: follow them
    return None
