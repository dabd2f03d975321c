"""The one-line quotes of a wrapped error that messages across xpupack use (`xpupack.errors`)."""

from xpupack.errors import error_line, first_line


def test_a_wrapped_error_is_quoted_by_the_first_line_of_its_message():
    exc = RuntimeError("  CUDA error: out of memory\nTraceback of the compiler:\n  ...")
    assert first_line(exc) == "CUDA error: out of memory"
    assert error_line(exc) == "RuntimeError: CUDA error: out of memory"


def test_an_error_without_a_message_is_quoted_by_its_type_alone():
    assert first_line(ValueError()) == "ValueError"
    assert error_line(ValueError("  \n")) == "ValueError"


def test_a_long_first_line_is_cut_so_that_the_message_stays_one_readable_line():
    exc = RuntimeError("x" * 5000)
    assert first_line(exc) == "x" * 300
    assert len(error_line(exc)) == len("RuntimeError: ") + 300
