"""A tokenizer's chat template, rendered with every way out bounded.

A ``chat_template`` comes with a tokenizer directory, that is, from whoever published the
checkpoint: it is a program. It runs in jinja2's immutable sandbox (no attribute of Python's
internals, no mutation of the messages), and besides:

* compiled once per command; a syntax error or an unknown filter is one line naming the line;
* every render of one sample together gets :data:`TIME_S` seconds (an interval timer in the main
  thread, where xfw prepares data): ``{% for i in range(99999) %}{% for j in range(99999) %}`` ends
  as an error, not as a preparation that never finishes;
* its output is read piece by piece and stops at :data:`MAX_CHARS`; what one C call could make too
  large to interrupt is refused before it runs: ``*`` and ``**`` beyond that size, a format width of
  a million (``"%999999999s" % x``, ``"{:999999999}".format(x)``), an argument beyond MAX_CHARS to any
  call, filter or test (``"x"|center(10**10)``); ``lipsum`` is gone;
* anything it raises (an undefined name used, a sandbox refusal, a type error, a recursion without
  end) becomes the caller's error class with the template's message.
"""

from __future__ import annotations

import contextlib
import functools
import re
import signal
import threading
from typing import Iterator

TIME_S = 5.0
"""Seconds every rendering of one sample may take together (a real chat template takes well under 1 ms)."""
MAX_CHARS = 4 << 20
"""The longest text a chat template may render, and the largest string, list or number ``*``/``**`` may make."""


class _Expired(BaseException):
    """Raised by the timer in the middle of a render; a BaseException so no ``except Exception`` keeps it."""


def _sandbox():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "%"])

        def call_binop(self, context, operator, left, right):
            if operator == "%" and isinstance(left, str):
                _check_format(left)
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and len(seq) * times > MAX_CHARS:
                        raise OverflowError(f"a repetition of {len(seq)} items {times} times is too large")
            if operator == "**" and type(left) is int and type(right) is int \
                    and abs(left) > 1 and right * abs(left).bit_length() > 4 * MAX_CHARS:
                raise OverflowError(f"{left} ** {right} is too large")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's own signature
            _check_sizes(args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

        def wrap_str_format(self, value):  # "...".format and format_map, checked when looked up
            wrapped = super().wrap_str_format(value)
            if wrapped is not None:
                _check_format(value.__self__)
            return wrapped

    return BoundedSandbox


_WIDE = re.compile(r"(%[^%a-zA-Z]*|\{[^{}]*:[^{}]*)\d{7,}")
"""A width or precision of seven digits or more in a ``%`` or ``{:...}`` format specification."""


def _check_format(text: str) -> None:
    """A format string whose width or precision alone would make millions of characters (``%999999999s``)."""
    if _WIDE.search(text):
        raise OverflowError("a format width of a million characters or more")


def _check_sizes(args, kwargs) -> None:
    """A call or filter asked for a size beyond MAX_CHARS (``"x"|center(10**10)``), refused before it runs."""
    for value in (*args, *kwargs.values()):
        if type(value) is int and abs(value) > MAX_CHARS:
            raise OverflowError(f"an argument of {value} is beyond what a chat template may ask for")


def _bounded_filter(function, name: str = ""):
    @functools.wraps(function)  # keeps jinja2's pass_context / pass_environment marks
    def bounded(*args, **kwargs):
        _check_sizes(args, kwargs)
        if name == "format":  # "%999999999s"|format(x): the value is the format string
            _check_format(next((a for a in args if isinstance(a, str)), ""))
        return function(*args, **kwargs)

    return bounded


_COMPILED: dict[str, object] = {}


def compile_chat_template(source, *, fail: type[Exception]):
    """The template compiled in the bounded sandbox (once per source); ``fail`` (an exception class)
    with one line for a template that is not a string, does not compile or names an unknown filter."""
    if not isinstance(source, str):
        raise fail(f"chat_template must be a string, got {type(source).__name__}")
    if source not in _COMPILED:
        from jinja2 import TemplateError as JinjaError

        def raise_exception(message):
            raise fail(f"the chat template says: {str(message)[:200]}")

        env = _sandbox()(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.globals.pop("lipsum", None)  # text by the million on request; no chat template needs it
        env.filters = {name: _bounded_filter(f, name) for name, f in env.filters.items()}
        env.tests = {name: _bounded_filter(f) for name, f in env.tests.items()}
        try:
            _COMPILED[source] = env.from_string(source)
        except JinjaError as err:
            line = getattr(err, "lineno", None)
            raise fail(f"chat_template does not compile{f' (line {line})' if line else ''}: "
                       f"{str(err).splitlines()[0][:200] if str(err) else type(err).__name__}") from None
        except (RecursionError, MemoryError, ValueError, TypeError) as err:
            raise fail(f"chat_template does not compile: {type(err).__name__}") from None
    return _COMPILED[source]


def render(template, fail: type[Exception], **values) -> str:
    """The template's text for ``values``; ``fail`` with the reason when it fails or grows past MAX_CHARS.
    Call it inside :func:`time_limit`."""
    pieces, size = [], 0
    try:
        for piece in template.generate(**values):
            size += len(piece)
            if size > MAX_CHARS:
                raise fail(f"the chat template renders more than {MAX_CHARS:,} characters")
            pieces.append(piece)
    except fail:
        raise
    except RecursionError:
        raise fail("the chat template recurses without end") from None
    except MemoryError:
        raise fail("the chat template ran out of memory") from None
    except Exception as err:  # noqa: BLE001 - jinja2's errors, the sandbox's, and whatever the template's operations raise
        message = str(err).splitlines()[0][:200] if str(err) else ""
        raise fail(f"the chat template fails: {type(err).__name__}{': ' + message if message else ''}") from None
    return "".join(pieces)


@contextlib.contextmanager
def time_limit(seconds: float, fail: type[Exception]) -> Iterator[None]:
    """Raise ``fail`` when the block runs past ``seconds`` (an interval timer; only in the main
    thread, and only when no other timer is set: elsewhere the block runs unbounded in time, bounded
    in size)."""
    if threading.current_thread() is not threading.main_thread() or signal.getitimer(signal.ITIMER_REAL)[0]:
        yield
        return

    done = []

    def expire(signum, frame):
        if not done:  # a timer that fires while the block is being left changes nothing
            raise _Expired

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except _Expired:
        raise fail(f"the chat template did not finish within {seconds:g} s (a loop without end?)") from None
    finally:
        done.append(True)
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
