"""The semantic cache's guard: the tokens that decide a question's answer (numbers, negations,
opposites, names, units, dates, comparisons, conversion direction) must agree between a question and
a cached one, whatever their embeddings' similarity (why and how well: `tidegate.cache.semantic`).
Pure: no I/O, no clock.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from dataclasses import dataclass

__all__ = ["AnswerTokens", "answer_tokens", "answer_token_mismatches", "answer_tokens_match"]


@dataclass(frozen=True, slots=True)
class AnswerTokens:
    """What `answer_tokens` reads from one question: the parts that decide its answer."""

    quantities: tuple[str, ...]  # numbers in order, each with the unit right after it: ("15 %", "200")
    operators: tuple[str, ...]  # arithmetic operators, sorted: ("*",) for "12 times 8"
    units: frozenset[str]  # units named without a number: "km" in "5 miles in km"
    negations: int  # not / no / never / without ... ("n't" expanded)
    names: frozenset[str]  # capitalised words not opening a sentence, acronyms, identifiers: "python"
    dates: frozenset[str]  # months, weekdays, today / tomorrow, parts of the day, seasons, quarters
    comparisons: frozenset[str]  # comparison words, synonyms folded: "taller", "highest" -> "height+"
    direction: frozenset[tuple[str, str]]  # (x, y) of "x to y" / "x into y" / "x in y"
    words: frozenset[str]  # every word, lower case, singular: what the cross-checks look up


# words that open questions and commands: capitalised only because they open a sentence, so never
# taken for names (a name must then appear in the other question too)
_SENTENCE_OPENERS = frozenset("""
a about above after again all also am an and any are as at be because been before being below both
but by can could did do does doing during each either every few for from had has have having he her
here hers him his how i i'm i've i'd i'll if in into is it its itself just let let's many me might
more most must my no nor not now of off on once one only or other our out over own please same she
should so some such than that the their them then there these they this those through to too under
until up very was we were what what's whats when where which while who whom whose why will with may shall
would yes you your yours hi hello hey thanks thank ok okay give tell show explain describe list name
write make create convert calculate compute find help translate summarize summarise define compare
suggest recommend generate multiply divide add subtract set remind get use is isn't are aren't
quick fast best good bad new old big small high low long short plus minus times remove delete
""".split())

_NEGATION_WORDS = frozenset((
    "not", "no", "never", "none", "nothing", "nobody", "nowhere", "neither", "nor", "without", "unable",
    "avoid", "except", "excluding", "lack", "lacks", "lacking",
))

# word -> canonical unit; "a" or "one" before a unit is the implicit quantity 1 (so "a cup" = "one
# cup" = "1 cup" = the unit named alone)
_UNITS: dict[str, str] = {}
for _canonical, _aliases in {
    "mg": "mg milligram milligrams", "g": "g gram grams gramme grammes", "kg": "kg kgs kilo kilos kilogram kilograms",
    "lb": "lb lbs pound pounds", "oz": "oz ounce ounces", "stone": "stone stones", "ton": "ton tons tonne tonnes",
    "mm": "mm millimeter millimeters millimetre millimetres", "cm": "cm centimeter centimeters centimetre centimetres",
    "m": "m meter meters metre metres", "km": "km kilometer kilometers kilometre kilometres",
    "inch": "inch inches", "ft": "ft foot feet", "yd": "yd yard yards", "mi": "mi mile miles",
    "ml": "ml milliliter milliliters millilitre millilitres", "l": "l liter liters litre litres",
    "tsp": "tsp teaspoon teaspoons", "tbsp": "tbsp tablespoon tablespoons", "cup": "cup cups",
    "pint": "pint pints", "quart": "quart quarts", "gallon": "gallon gallons",
    "ms": "ms millisecond milliseconds", "s": "s sec secs second seconds", "min": "min mins minute minutes",
    "h": "h hr hrs hour hours", "day": "day days", "week": "week weeks", "month": "month months",
    "year": "year years yr yrs", "decade": "decade decades", "century": "century centuries",
    "celsius": "celsius centigrade", "fahrenheit": "fahrenheit", "kelvin": "kelvin", "deg": "degree degrees",
    "bit": "bit bits", "byte": "byte bytes", "kb": "kb kilobyte kilobytes", "mb": "mb megabyte megabytes",
    "gb": "gb gigabyte gigabytes", "tb": "tb terabyte terabytes", "mbit": "mbit megabit megabits",
    "gbit": "gbit gigabit gigabits", "w": "w watt watts", "kw": "kw kilowatt kilowatts",
    "kwh": "kwh kilowatt-hour kilowatt-hours", "v": "v volt volts", "a": "amp amps ampere amperes",
    "mah": "mah", "hz": "hz hertz", "ghz": "ghz gigahertz", "mhz": "mhz megahertz",
    "kcal": "kcal cal calorie calories", "j": "joule joules",
    "usd": "usd dollar dollars buck bucks $", "eur": "eur euro euros €", "gbp": "gbp sterling £",
    "jpy": "jpy yen ¥", "%": "% percent percentage pct",
}.items():
    for _alias in _aliases.split():
        _UNITS[_alias] = _canonical
# shorthands for a unit per unit
_RATE_UNITS = {"mph": "mi/h", "kph": "km/h", "kmh": "km/h", "mps": "m/s", "mbps": "mbit/s", "gbps": "gbit/s",
               "rpm": "rev/min", "fps": "frame/s"}
# counted as units only right after a number: elsewhere they are ordinary words ("a", "in", "s")
_UNITS_AFTER_NUMBERS_ONLY = frozenset(("g", "m", "l", "s", "h", "w", "v", "min", "second", "seconds"))
_CURRENCY_SYMBOLS = frozenset("$€£¥")

_NUMBER_WORDS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen".split())}
_NUMBER_WORDS.update({w: 10 * (i + 2) for i, w in enumerate(
    "twenty thirty forty fifty sixty seventy eighty ninety".split())})
_SCALE_WORDS = {"hundred": 100, "thousand": 1_000, "million": 1_000_000, "billion": 1_000_000_000}
_ORDINAL_WORDS = {w: i + 1 for i, w in enumerate(
    "first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth".split())}
_FRACTION_WORDS = {"half": "0.5", "quarter": "0.25", "quarters": "0.25", "dozen": "12"}
_MULTIPLIER_WORDS = {"double": "x2", "twice": "x2", "triple": "x3", "thrice": "x3", "quadruple": "x4"}
_OPERATOR_WORDS = {"plus": "+", "minus": "-", "multiply": "*", "multiplied": "*", "divide": "/", "divided": "/",
                   "sqrt": "sqrt", "squared": "^2", "cubed": "^3", "factorial": "!", "modulo": "%mod", "mod": "%mod"}
# with one of these the order of the numbers changes the answer ("10 minus 3"); otherwise it does
# not ("average of 10, 20 and 30", "30% off $80" = "$80 less 30%")
_ORDER_SENSITIVE_OPERATORS = frozenset(("-", "/", "^", "%mod"))
_OPERATOR_SYMBOLS = {"+": "+", "-": "-", "*": "*", "x": "*", "×": "*", "/": "/", "÷": "/", "^": "^", "!": "!"}

_MONTHS = frozenset(
    "january february march april june july august september october november december".split())
_DATE_WORDS = _MONTHS | frozenset(
    "monday tuesday wednesday thursday friday saturday sunday today tomorrow yesterday tonight morning "
    "afternoon evening night midnight noon weekend weekday am pm spring summer autumn winter q1 q2 q3 q4".split())

# comparison words -> the quantity they compare and its direction; synonyms share a token, so
# "tallest" and "highest" agree, "tallest" and "oldest" do not
_COMPARISONS: dict[str, str] = {}
for _token, _words in {
    "amount+": "more most greater greatest max maximum maximize maximise increase increases increased increasing "
               "ascending asc exceed exceeds",
    "amount-": "less least fewer fewest min minimum minimize minimise decrease decreases decreased decreasing "
               "descending desc reduce reduces reduced",
    "size+": "larger largest bigger biggest", "size-": "smaller smallest",
    "height+": "higher highest taller tallest high tall raise raises raised top above upper",
    "height-": "lower lowest low below bottom",
    "length+": "longer longest", "length-": "shorter shortest",
    "speed+": "faster fastest quicker quickest fast quick quickly", "speed-": "slower slowest slow slowly",
    "cost+": "expensive pricier priciest costlier costliest", "cost-": "cheaper cheapest cheap",
    "temperature+": "hotter hottest warmer warmest hot warm", "temperature-": "colder coldest cold",
    "age+": "older oldest elder eldest old", "age-": "newer newest younger youngest latest",
    "weight+": "heavier heaviest heavy", "weight-": "lighter lightest",
    "quality+": "better best", "quality-": "worse worst bad",
    "ease+": "easier easiest easy simpler simplest", "ease-": "harder hardest difficult",
    "distance+": "farther farthest further furthest far", "distance-": "closer closest nearer nearest near",
    "depth+": "deeper deepest deep", "depth-": "shallower shallowest shallow",
    "time-before": "before earlier earliest prior previous preceding ago",
    "time-after": "after later following next subsequent",
    "position-end": "last final", "side-left": "left", "side-right": "right",
}.items():
    for _word in _words.split():
        _COMPARISONS[_word] = _token

# "more" / "less" before a comparison word: its direction kept or turned round
_DEGREE_WORDS = {"more": "+", "most": "+", "less": "-", "least": "-"}

# opposites that no prefix rule finds: (x, y) disagree when one question says x and the other y
_OPPOSITE_WORDS = frozenset(frozenset(pair.split()) for pair in (
    "open closed", "open close", "add remove", "push pull", "start stop", "start end", "start finish",
    "begin end", "read write", "buy sell", "borrow lend", "win lose", "accept reject",
    "allow deny", "allow block", "true false", "right wrong", "input output", "send receive",
    "positive negative", "odd even", "inner outer", "inside outside", "internal external",
    "horizontal vertical", "male female", "north south", "east west", "up down", "in out",
    "forward backward", "forwards backwards", "ahead behind", "early late", "uppercase lowercase",
    "import export", "upload download", "login logout", "on off", "online offline", "show hide",
    "shown hidden", "visible hidden", "attach detach", "expand collapse", "merge split", "enter exit",
    "arrive depart", "arrival departure", "success failure", "safe dangerous", "empty full", "alive dead",
    "light dark", "wet dry", "hard soft", "strong weak", "rich poor", "sweet sour", "public private",
    "local remote", "global local", "static dynamic", "sync async", "client server", "love hate",
))
# a word and the same word behind one of these prefixes are opposites: "safe" / "unsafe"
_NEGATING_PREFIXES = ("un", "in", "im", "il", "ir", "dis", "non", "de", "anti", "non-")
# words that differ only by these opposed prefixes are opposites: "include" / "exclude", "enable" / "disable"
_OPPOSED_PREFIXES = (("in", "ex"), ("im", "ex"), ("in", "de"), ("en", "de"), ("en", "dis"), ("up", "down"),
                     ("over", "under"), ("max", "min"), ("pre", "post"), ("in", "out"), ("inc", "dec"))
_MIN_STEM = 4  # shorter stems make false opposites ("de" + "fine" is not the opposite of "fine")

_DETERMINERS = frozenset("a an the my your our their this that these those some any one its his her".split())
_DIRECTION_PIVOTS = frozenset(("to", "into", "in"))

_TOKEN = re.compile(
    r"(?P<number>\d+(?:[.,:]\d+)*)"
    r"|(?P<word>[^\W\d_](?:[\w'+#.-]*[\w+#])?)"
    r"|(?P<symbol>[%$€£¥+*/^×÷!-])"
)
_SENTENCE_BREAK = re.compile(r"[.?!:;\n]")
_REWRITES = [(re.compile(pattern, re.IGNORECASE), replacement) for pattern, replacement in (
    (r"[’`]", "'"),
    (r"\bcan'?t\b|\bcannot\b", "can not"), (r"\bwon'?t\b", "will not"), (r"\bshan't\b", "shall not"),
    (r"n't\b", " not"),
    (r"°\s*c\b|\bdeg(?:ree)?s?\s+(?:celsius|centigrade)\b", " celsius"),
    (r"°\s*f\b|\bdeg(?:ree)?s?\s+fahrenheit\b", " fahrenheit"),
    (r"°", " degrees"),
    (r"\bsquare\s+root\b", " sqrt "), (r"\bto\s+the\s+power\s+of\b", " ^ "), (r"\bper\s+cent\b", " percent"),
    (r"\ba\.m\.", " am "), (r"\bp\.m\.", " pm "),
    (r"\b(\d+)(st|nd|rd|th)\b", r"\1"),  # ordinal suffixes: "3rd" = "3"
    (r"\b(\d+)([a-z]+)\b", r"\1 \2"),  # "5km", "3pm", "100mg": a number and its unit
)]


# words ending in "est" that are not superlatives
_NOT_SUPERLATIVES = frozenset("""
arrest attest behest bequest best chest congest conquest contest detest digest divest earnest forest guest
harvest honest infest ingest inquest interest invest jest lest manifest modest molest nest pest priest
protest quest request rest suggest tempest test unrest vest west zest
""".split())


def _is_superlative(word: str) -> bool:
    return len(word) >= 6 and word.endswith("est") and word.isalpha() and word not in _NOT_SUPERLATIVES


def _normalise_number(raw: str) -> str:
    if re.fullmatch(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?", raw):  # thousands separators: "2,000" = "2000"
        raw = raw.replace(",", "")
    if re.fullmatch(r"\d+\.\d+", raw):  # "3.50" = "3.5", "2.0" = "2"
        raw = raw.rstrip("0").rstrip(".")
    if re.fullmatch(r"\d+", raw):
        raw = str(int(raw))  # "007" = "7"
    return raw


def _format_value(value: float) -> str:
    return str(int(value)) if value == int(value) else repr(value)


def _singular(word: str) -> str:
    if len(word) > 3 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 3 and word.endswith("s") and not word.endswith("ss"):
        return word[:-1]
    return word


@dataclass(slots=True)
class _Token:
    text: str  # as written (case kept)
    lower: str  # lower case, possessive "'s" dropped
    kind: str  # "number" | "word" | "symbol"
    opens_sentence: bool


def _tokenise(text: str) -> list[_Token]:
    text = unicodedata.normalize("NFKC", text)
    for pattern, replacement in _REWRITES:
        text = pattern.sub(replacement, text)
    tokens: list[_Token] = []
    end = 0
    for match in _TOKEN.finditer(text):
        opens_sentence = not tokens or bool(_SENTENCE_BREAK.search(text, end, match.start()))
        end = match.end()
        kind = match.lastgroup or "symbol"
        raw = match.group()
        lower = raw.lower()
        if kind == "word":
            lower = re.sub(r"'s$", "", lower).strip("'")
            if "-" in lower and all(part in _NUMBER_WORDS for part in lower.split("-")):
                # "twenty-five": number words, read as the number
                for part in lower.split("-"):
                    tokens.append(_Token(part, part, "word", opens_sentence))
                    opens_sentence = False
                continue
        tokens.append(_Token(raw, lower, kind, opens_sentence))
    return tokens


def _is_name(token: _Token) -> bool:
    """A word that names something: capitalised inside a sentence, an acronym or a mixed-case word
    ("iPhone"), an identifier with digits or code characters ("python3", "node.js", "C++"), or a
    capitalised word opening a sentence that is not a common opener ("Paris is ...")."""
    word = token.text
    if token.kind != "word" or token.lower in ("i", "i'm", "i've", "i'd", "i'll"):
        return False
    if any(c.isdigit() for c in word) or any(c in "_.+#" for c in word):
        return True
    if any(c.isupper() for c in word[1:]):
        return True
    if not word[0].isupper():
        return False
    return not token.opens_sentence or token.lower not in _SENTENCE_OPENERS


def _read_number_words(tokens: list[_Token], start: int) -> tuple[float, int, bool] | None:
    """(value, tokens used, whether it was the word "one" alone) for number words at `start`, else None."""
    total, current, used, seen = 0.0, 0.0, 0, False
    i = start
    while i < len(tokens):
        word = tokens[i].lower
        if word in _NUMBER_WORDS:
            current += _NUMBER_WORDS[word]
        elif word in _SCALE_WORDS and (seen or word == "hundred"):
            current = max(current, 1.0) * _SCALE_WORDS[word]
            if _SCALE_WORDS[word] > 100:
                total, current = total + current, 0.0
        elif word == "and" and seen and i + 1 < len(tokens) and (
                tokens[i + 1].lower in _NUMBER_WORDS or tokens[i + 1].lower in _SCALE_WORDS):
            pass  # "one hundred and five"
        elif word == "a" and not seen and i + 1 < len(tokens) and tokens[i + 1].lower in _SCALE_WORDS:
            current, seen = 1.0, True  # "a hundred"
            i += 1
            continue
        else:
            break
        seen = True
        i += 1
        used = i - start
    if not seen or used == 0:
        return None
    only_one = used == 1 and tokens[start].lower == "one"
    return total + current, used, only_one


def _unit_at(tokens: list[_Token], i: int, after_number: bool) -> tuple[str, int] | None:
    """(canonical unit, tokens used) at `i`, a rate ("km per hour", "km/h", "mph") read as one unit."""
    if i >= len(tokens):
        return None
    word = tokens[i].lower
    if word in _RATE_UNITS:
        return _RATE_UNITS[word], 1
    if word not in _UNITS or (word in _UNITS_AFTER_NUMBERS_ONLY and not after_number):
        return None
    unit, used = _UNITS[word], 1
    if i + 2 < len(tokens) and tokens[i + 1].lower in ("per", "/") and tokens[i + 2].lower in _UNITS:
        unit, used = f"{unit}/{_UNITS[tokens[i + 2].lower]}", 3
    return unit, used


def answer_tokens(text: str) -> AnswerTokens:
    """Reads the tokens that decide a question's answer (see `answer_tokens_match`)."""
    tokens = _tokenise(text)
    quantities: list[str] = []
    operators: list[str] = []
    units: set[str] = set()
    names: set[str] = set()
    dates: set[str] = set()
    comparisons: set[str] = set()
    negations = 0
    i = 0
    while i < len(tokens):
        token = tokens[i]
        word = token.lower
        previous = tokens[i - 1].lower if i else ""
        # a number (digits or words), then the unit right after it if any
        number: str | None = None
        implicit_one = False
        used = 1
        if token.kind == "number":
            number = _normalise_number(token.text)
            if previous in _UNITS and previous in _CURRENCY_SYMBOLS:  # "$45"
                quantities.append(f"{number} {_UNITS[previous]}")
                i += 1
                continue
        elif token.kind == "word" and (read := _read_number_words(tokens, i)) is not None:
            value, used, implicit_one = read
            number = _format_value(value)
        elif word in _FRACTION_WORDS:
            number = _FRACTION_WORDS[word]
        elif word in _MULTIPLIER_WORDS:
            number = _MULTIPLIER_WORDS[word]
        elif word in _ORDINAL_WORDS and not (word == "second" and previous in ("a", "per", "one")):
            number = str(_ORDINAL_WORDS[word])
        elif word in ("a", "an", "per") and (unit := _unit_at(tokens, i + 1, after_number=False)) is not None:
            units.add(unit[0])  # "a cup", "per ounce": the unit alone
            i += 1 + unit[1]
            continue
        if number is not None:
            if i + used + 1 < len(tokens) and tokens[i + used].lower == "times" \
                    and tokens[i + used + 1].kind != "number" and tokens[i + used + 1].lower not in _NUMBER_WORDS:
                quantities.append(f"x{number}")  # "two times" = "twice"; "12 times 8" is a product
                i += used + 1
                continue
            unit = _unit_at(tokens, i + used, after_number=True)
            if unit is not None and (number == "1" or implicit_one):
                units.add(unit[0])  # "1 cup" = "a cup" = "cup"
                i += used + unit[1]
                continue
            if unit is not None:
                quantities.append(f"{number} {unit[0]}")
                i += used + unit[1]
                continue
            if not implicit_one:  # "one" alone is a pronoun ("which one"), not a number
                quantities.append(number)
            i += used
            continue
        if word in _OPERATOR_WORDS:
            operators.append(_OPERATOR_WORDS[word])
        elif word == "times" and i and (tokens[i - 1].kind == "number" or previous in _NUMBER_WORDS):
            operators.append("*")
        elif token.kind == "symbol" and token.text in _OPERATOR_SYMBOLS or word == "x":
            # an operator only between numbers: "20/4", "3 x 4"; not "and/or", "USB-C"
            if 0 < i < len(tokens) - 1 and tokens[i - 1].kind == "number" and tokens[i + 1].kind == "number":
                operators.append(_OPERATOR_SYMBOLS.get(token.text, "*"))
        elif token.kind == "symbol" and token.text in _UNITS:
            # "%" after a number went with it; "$" before one goes with the number
            if not (i + 1 < len(tokens) and tokens[i + 1].kind == "number"):
                units.add(_UNITS[token.text])
        elif (unit := _unit_at(tokens, i, after_number=False)) is not None:
            units.add(unit[0])
            i += unit[1]
            continue
        if word in _NEGATION_WORDS:
            negations += 1
        if word in ("am", "pm") and (i == 0 or tokens[i - 1].kind != "number"):
            pass  # "Am I ...": a time of day only after a number ("7 am")
        elif word in _DATE_WORDS or _singular(word) in _DATE_WORDS:
            dates.add(_singular(word) if _singular(word) in _DATE_WORDS else word)
        elif word == "may" and (token.text == "May" and not token.opens_sentence or (
                i + 1 < len(tokens) and tokens[i + 1].kind == "number")):
            dates.add("may")  # the month, not the verb
        elif word not in _COMPARISONS and _is_superlative(word) and (token.text.islower() or token.opens_sentence):
            comparisons.add(word)  # "safest", "cleanest": a quantity no synonym list names
        elif word in _COMPARISONS:
            following = tokens[i + 1].lower if i + 1 < len(tokens) else ""
            if word in _DEGREE_WORDS and _COMPARISONS.get(following, "").endswith(("+", "-")):
                # "less expensive" = "cheaper" (cost-), "more difficult" = "harder" (ease-)
                quality = _COMPARISONS[following]
                flip = _DEGREE_WORDS[word] == "-"
                comparisons.add(quality[:-1] + ("-" if (quality[-1] == "-") != flip else "+"))
                i += 2
                continue
            comparisons.add(_COMPARISONS[word])
        elif _is_name(token) and word not in _UNITS and word not in _RATE_UNITS:
            names.add(word)
        i += 1
    words = frozenset(w for t in tokens if t.kind == "word" for w in (t.lower, _singular(t.lower)))
    return AnswerTokens(
        quantities=tuple(quantities), operators=tuple(sorted(operators)), units=frozenset(units),
        negations=negations, names=frozenset(names), dates=frozenset(dates),
        comparisons=frozenset(comparisons), direction=_direction_pairs(tokens), words=words,
    )


def _canonical(word: str) -> str:
    return _UNITS.get(word) or _RATE_UNITS.get(word) or _singular(word)


def _direction_pairs(tokens: list[_Token]) -> frozenset[tuple[str, str]]:
    """(x, y) for each "x to y", "x into y", "x in y": the word before the pivot and the first word
    after it that is not a determiner or a number."""
    pairs = set()
    for i, token in enumerate(tokens[1:-1], start=1):
        if token.lower not in _DIRECTION_PIVOTS:
            continue
        j = i + 1
        while j < len(tokens) and (tokens[j].lower in _DETERMINERS or tokens[j].kind == "number"):
            j += 1
        if j < len(tokens) and tokens[j].kind == "word" and tokens[i - 1].kind == "word":
            pairs.add((_canonical(tokens[i - 1].lower), _canonical(tokens[j].lower)))
    return frozenset(pairs)


def _both_replaced(a: frozenset[str], b: frozenset[str], a_words: frozenset[str], b_words: frozenset[str]) -> bool:
    """True when each side has a token the other question does not contain at all.

    One-sided additions pass ("What's the tallest mountain in the world?" / "Which mountain is the
    highest on Earth?" adds the name Earth); a replacement does not ("capital of Australia" /
    "capital of Austria").
    """
    return bool({t for t in a - b if t not in b_words}) and bool({t for t in b - a if t not in a_words})


def _comparisons_disagree(a: frozenset[str], b: frozenset[str]) -> bool:
    """`_both_replaced` for comparison tokens, where the generic "more" / "less" (amount+ / amount-)
    agrees with any comparison of the same direction: "rise more" = "rise higher"."""
    only_a, only_b = a - b, b - a

    def specific(tokens: frozenset[str], other: frozenset[str]) -> set[str]:
        other_signs = {t[-1] for t in other if t[-1] in "+-"}
        return {t for t in tokens if not (t.startswith("amount") and t[-1] in other_signs)}

    return bool(specific(only_a, only_b)) and bool(specific(only_b, only_a))


def _are_opposites(x: str, y: str) -> bool:
    if frozenset((x, y)) in _OPPOSITE_WORDS:
        return True
    for short, long in ((x, y), (y, x)):
        if len(short) >= _MIN_STEM and any(long == prefix + short for prefix in _NEGATING_PREFIXES):
            return True
    for first, second in _OPPOSED_PREFIXES:
        for p, q in ((x, y), (y, x)):
            if p.startswith(first) and q.startswith(second) and len(p) - len(first) >= _MIN_STEM - 1 \
                    and p[len(first):] == q[len(second):]:
                return True
    return False


def answer_token_mismatches(a: AnswerTokens, b: AnswerTokens) -> tuple[str, ...]:
    """The rules of `answer_tokens_match` that two questions' tokens break; empty when they match."""
    broken = []
    ordered = _ORDER_SENSITIVE_OPERATORS.intersection(a.operators + b.operators)
    same_quantities = a.quantities == b.quantities if ordered else Counter(a.quantities) == Counter(b.quantities)
    if not same_quantities or Counter(a.operators) != Counter(b.operators):
        broken.append("numbers")
    if a.negations != b.negations:
        broken.append("negation")
    if _both_replaced(a.names, b.names, a.words, b.words):
        broken.append("names")
    if _both_replaced(a.units, b.units, frozenset(), frozenset()):
        broken.append("units")
    if a.dates != b.dates:
        broken.append("dates")
    if _comparisons_disagree(a.comparisons, b.comparisons):
        broken.append("comparison")
    only_a, only_b = a.words - b.words, b.words - a.words
    if any(_are_opposites(x, y) for x in only_a for y in only_b):
        broken.append("opposites")
    if any((y, x) in b.direction for (x, y) in a.direction if x != y):
        broken.append("direction")
    return tuple(broken)


def answer_tokens_match(a: str, b: str) -> bool:
    """The guard: True when two look-alike questions agree on every token that decides an answer.

    Each rule, and the near-miss category of src/tidegate/data/semantic_pairs.jsonl that needs it
    (the bench prints how many pairs of each category each rule stops):

    - numbers (category `number`): the numbers in order, each with the unit right after it, must be
      equal, and the arithmetic operators too. Numbers are normalised ("2,000" = "2000",
      "3.50" = "3.5", "five" = "5", "3rd" = "third" = "3", "$45" = "45 dollars"); "one", "a" or
      "1" before a unit is the unit alone ("a cup" = "one cup"); "one" alone is a pronoun, ignored.
      Order counts: "10 minus 3" is not "3 minus 10".
    - negation (`negation`): as many negations (not, no, never, without, none, unable, "n't" ...).
    - opposites (`negation`, `comparison`): no word of one may be the opposite of a word of the
      other: a negating prefix ("safe" / "unsafe", "tracked" / "untracked", "legal" / "illegal"),
      opposed prefixes ("include" / "exclude", "enable" / "disable"), or a short list of common
      opposites ("open" / "closed", "read" / "write").
    - names (`name`): capitalised words not opening a sentence, acronyms, mixed case ("iPhone") and
      identifiers ("python3", "C++"). Fails when *each* side has a name the other question does
      not contain in any case ("Australia" / "Austria"); a name only one side adds passes, since
      paraphrases add context ("on Earth", "Google Chrome").
    - units (`unit`): units named without a number ("in km", "per ounce"), rates read as one unit
      ("km per hour" = "km/h"); fails when each side has a unit the other lacks ("watts" / "amps"),
      not when one side adds one ("How long ..." / "How many minutes ...").
    - dates (`date`): months, weekdays, today / tomorrow / yesterday, parts of the day, am / pm,
      seasons, quarters must be the same set ("May" counts only as a month: capitalised inside a
      sentence or next to a number).
    - comparison (`comparison`): comparison words folded to the quantity and direction they
      compare ("tallest" = "highest" = height+, "cheaper" = cost-, before / after, left / right,
      last); fails when each side has one the other lacks ("largest" / "smallest",
      "tallest" / "oldest"), not when one side adds one ("best way to" / "how do I").
    - direction (`unit`, `unrelated_same_topic`): "x to y" on one side and "y to x" on the other
      ("Celsius to Fahrenheit" / "Fahrenheit to Celsius", "a list to a string" / "a string to a list").

    Pairs that differ in none of these (the category `unrelated_same_topic`: "time complexity" /
    "space complexity") are left to the similarity threshold.
    """
    return not answer_token_mismatches(answer_tokens(a), answer_tokens(b))
