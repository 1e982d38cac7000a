"""The data flags' strings, parsed where the flags are checked (DataConfig) and where the
datasets are built (megatron/data): --split and --data-path."""
import math


def parse_split_weights(splits_string: str) -> list[float]:
    """'969,30,1' or '969/30/1' (missing numbers are 0) -> three weights summing to 1."""
    separator = "," if "," in splits_string else "/"
    try:
        weights = [float(part) for part in splits_string.split(separator)]
    except ValueError:
        raise ValueError(f"--split {splits_string!r}: expected numbers like '969,30,1' or '969/30/1'") from None
    if len(weights) > 3 or any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--split {splits_string!r}: expected up to 3 non-negative numbers with a positive sum")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return [w / total for w in weights]


def parse_data_prefix(data_prefix: list[str]) -> tuple[list[str], list[float]]:
    """--data-path as `[prefix]` or `[w1, p1, w2, p2, ...]` -> (prefixes, normalised weights)."""
    if not data_prefix:
        raise ValueError("--data-path is empty: give a dataset prefix, or weight/prefix pairs")
    if len(data_prefix) == 1:
        return [str(data_prefix[0])], [1.0]
    if len(data_prefix) % 2:
        raise ValueError(f"--data-path {' '.join(map(str, data_prefix))}: expected one prefix or weight/prefix pairs")
    prefixes, weights = [], []
    for weight, prefix in zip(data_prefix[0::2], data_prefix[1::2]):
        try:
            weights.append(float(weight))
        except ValueError:
            raise ValueError(f"--data-path: weight {weight!r} (before {prefix!r}) is not a number") from None
        prefixes.append(str(prefix).strip())
    if not all(math.isfinite(w) for w in weights):
        raise ValueError(f"--data-path weights {weights}: every weight must be a finite number "
                         f"(nan and inf cannot be normalised); give each dataset a weight >= 0")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--data-path weights {weights} must be non-negative with a positive sum")
    total = left_to_right_sum(weights)
    return prefixes, [w / total for w in weights]


def left_to_right_sum(values) -> float:
    """Plain float accumulation, as Megatron normalises blend weights (Python 3.12's sum()
    is compensated and can differ in the last bit, changing sample counts and cache names)."""
    total = 0.0
    for value in values:
        total += value
    return total
