import gc
import weakref

import pytest

from danling.utils import catch, flexible_decorator, method_cache


def raise_(error):
    raise error


class TestCatch:
    def test_catches_and_returns_none_printing_traceback(self, capsys):
        func = catch(OSError)(lambda: raise_(FileNotFoundError("disk gone")))
        assert func() is None
        err = capsys.readouterr().err
        assert "Traceback" in err and "FileNotFoundError: disk gone" in err

    def test_passes_through_return_value_and_metadata(self):
        @catch
        def add(a, b=1):
            """Add."""
            return a + b

        assert add(2, b=3) == 5
        assert add.__name__ == "add" and add.__doc__ == "Add."

    def test_uncaught_and_excluded_errors_propagate(self):
        with pytest.raises(KeyError):
            catch(OSError)(lambda: raise_(KeyError("k")))()
        with pytest.raises(FileNotFoundError):
            catch(OSError, exclude=FileNotFoundError)(lambda: raise_(FileNotFoundError()))()
        with pytest.raises(PermissionError):
            catch((ValueError, OSError), exclude=(KeyError, PermissionError))(lambda: raise_(PermissionError()))()

    def test_default_does_not_catch_keyboard_interrupt(self):
        with pytest.raises(KeyboardInterrupt):
            catch()(lambda: raise_(KeyboardInterrupt()))()

    def test_custom_callback_receives_context(self):
        seen = []

        def callback(exc, func, args, kwargs, *extra, **extra_kwargs):
            seen.append((type(exc), func.__name__, args, kwargs, extra, extra_kwargs))

        def fail(x, y=None):
            raise ValueError(x)

        wrapped = catch(ValueError, None, callback, "tag", level=2)(fail)
        assert wrapped(1, y=2) is None
        assert seen == [(ValueError, "fail", (1,), {"y": 2}, ("tag",), {"level": 2})]

    def test_print_exc_receives_extra_arguments(self, capsys):
        catch(ValueError, None, __import__("traceback").print_exc, 0)(lambda: raise_(ValueError("x")))()
        assert "ValueError: x" in capsys.readouterr().err

    @pytest.mark.parametrize(
        ("kwargs", "match"),
        [
            ({"error": "OSError"}, "error to be an exception class"),
            ({"error": ()}, "error to be an exception class"),
            ({"error": int}, "error to be an exception class"),
            ({"exclude": [KeyError]}, "exclude to be an exception class"),
            ({"callback": 3}, "callback to be callable"),
        ],
    )
    def test_bad_arguments(self, kwargs, match):
        with pytest.raises(TypeError, match=r"catch\(\) expects " + match):
            catch(**kwargs)


class TestFlexibleDecorator:
    def test_with_and_without_brackets(self):
        @flexible_decorator()
        def prefix(text=">"):
            def decorator(func):
                return lambda *a: text + func(*a)

            return decorator

        @prefix
        def a():
            return "a"

        @prefix("#")
        def b():
            return "b"

        @prefix(text="!")
        def c():
            return "c"

        assert (a(), b(), c()) == (">a", "#b", "!c")
        assert prefix.__name__ == "prefix"

    def test_class_argument_is_an_option_not_a_target(self):
        @flexible_decorator
        def record(kind=Exception):
            def decorator(func):
                func.kind = kind
                return func

            return decorator

        @record(ValueError)
        def f():
            pass

        assert f.kind is ValueError

    def test_rejects_non_callable(self):
        with pytest.raises(TypeError, match="callable decorator factory"):
            flexible_decorator(3)


class Counter:
    def __init__(self):
        self.calls = 0

    @method_cache(maxsize=2)
    def double(self, x):
        self.calls += 1
        return 2 * x

    @method_cache
    def unbounded(self, *args, **kwargs):
        self.calls += 1
        return args, tuple(sorted(kwargs.items()))


class TestMethodCache:
    def test_caches_per_instance(self):
        a, b = Counter(), Counter()
        assert [a.double(1), a.double(1), a.double(2)] == [2, 2, 4]
        assert a.calls == 2
        assert b.double(1) == 2 and b.calls == 1

    def test_maxsize_evicts_least_recent(self):
        c = Counter()
        for x in (1, 2, 3, 1):
            c.double(x)
        assert c.calls == 4  # 1 was evicted when 3 arrived

    def test_bare_decorator_and_kwargs(self):
        c = Counter()
        assert c.unbounded(1, k=2) == ((1,), (("k", 2),))
        c.unbounded(1, k=2)
        assert c.calls == 1

    def test_typed(self):
        class Typed:
            calls = 0

            @method_cache(typed=True)
            def f(self, x):
                Typed.calls += 1
                return x

        t = Typed()
        t.f(1)
        t.f(1.0)
        assert Typed.calls == 2

    def test_instances_are_garbage_collected(self):
        c = Counter()
        c.double(1)
        ref = weakref.ref(c)
        del c
        gc.collect()
        assert ref() is None

    def test_cycle_garbage_is_collected_and_cache_dropped(self):
        class Node:
            @method_cache
            def value(self):
                return object()

        node = Node()
        node.self_ref = node  # reference cycle, needs the cyclic collector
        first = node.value()
        assert node.value() is first
        ref = weakref.ref(node)
        del node
        gc.collect()
        assert ref() is None
        # A new instance never sees the old cached result.
        assert Node().value() is not first

    def test_unhashable_instances_work(self):
        class Mapping(dict):
            @method_cache
            def size(self):
                return len(self)

        assert Mapping(a=1).size() == 1

    def test_cache_clear(self):
        c = Counter()
        c.double(1)
        Counter.double.cache_clear()
        c.double(1)
        assert c.calls == 2

    def test_requires_weakref_support(self):
        class Slotted:
            __slots__ = ()

            @method_cache
            def f(self):
                return 1

        with pytest.raises(TypeError, match="weak references.*Slotted"):
            Slotted().f()

    def test_unhashable_arguments(self):
        with pytest.raises(TypeError, match="unhashable"):
            Counter().double([1])

    @pytest.mark.parametrize("maxsize", ["8", 1.5, True])
    def test_bad_maxsize(self, maxsize):
        with pytest.raises(TypeError, match="maxsize"):
            method_cache(maxsize)
