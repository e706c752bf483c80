"""Tools of the agents tests, as a user would write them."""

from typing import Dict, List, Literal, Optional, Union


def add(a: int, b: float = 2.0) -> float:
    """Adds two numbers.

    Args:
        a: The first number.
        b: The second number, which
            goes on over two lines.

    Returns:
        Their sum.
    """
    return a + b


def pick(names: List[str], mode: Literal["first", "last"], limit: Optional[int] = None,
         strict: bool = False, key: Union[int, str] = 0, options: Dict[str, int] = None) -> str:
    """Picks a name
    from a list.

    Args:
        names: The names to pick from.
        mode: Which end to pick from.
        limit (int): At most this many are looked at.
        strict: Whether to fail on an empty list.
        key: A key, a number or a text.
        options: Anything else.
    """
    del limit, strict, key, options
    return names[0] if mode == "first" else names[-1]


def undocumented(x: int) -> int:
    return x


def half_documented(x: int, y: int) -> int:
    """Adds.

    Args:
        x: One.
    """
    return x + y


def unannotated(x):
    """Echoes.

    Args:
        x: Anything.
    """
    return x


def varargs(*numbers: int) -> int:
    """Sums.

    Args:
        numbers: The numbers.
    """
    return sum(numbers)


class Point:
    pass


def takes_a_point(p: Point) -> int:
    """Reads a point.

    Args:
        p: The point.
    """
    return 0


def failing(x: int) -> int:
    """Fails.

    Args:
        x: Anything.
    """
    raise ValueError(f"no {x}")
