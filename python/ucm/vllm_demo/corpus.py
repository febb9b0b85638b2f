"""Generated English text for the real-model demo, tests and quality benchmark.

Everything here is made from a seed (no data set to download): filler prose
about invented towns, pass-key needles hidden in it (needle retrieval, as in
the pass-key and RULER tasks), and short records about invented landmarks
for a multi-document question-answering set (RAG). Prompts are token lists
in SmolLM2-Instruct's chat format, assembled from separately tokenized
pieces so that a shared part (a haystack, a chunk) has the same tokens in
every prompt that contains it.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

TOWNS = (
    "Alder Bay, Bramford, Caldwick, Dunmore, Elmstead, Fernhollow, Glenrock, Harrowgate, "
    "Ivybridge, Juniper Falls, Kestrel Point, Larkspur, Millbrook, Northwood, Oakhaven, "
    "Pinecrest, Queensferry, Ravenscar, Stonebury, Thornfield, Upton Marsh, Valewood, "
    "Westmere, Yarrow Hill, Ashcombe, Birchmoor, Copperfield, Deepwater, Eastbrook, Foxley"
).split(", ")
PEOPLE = (
    "Anna Hale, Ben Carter, Clara Voss, Daniel Reed, Elena Marsh, Felix Grant, Grace Lin, "
    "Hugo Brandt, Iris Cole, Jonas Webb, Karin Holt, Leo Ford, Maya Quinn, Nils Berg, "
    "Olivia Stone, Paul Dorn, Rosa Kent, Samuel Price, Tara Wells, Victor Lund, Wendy Shaw, "
    "Aaron Blake, Beatrice Moss, Conrad Pike, Delia Frost, Edgar Vane, Fiona Clark"
).split(", ")
TRADES = (
    "baker, blacksmith, weaver, potter, carpenter, fisherman, miller, cooper, tailor, "
    "shepherd, brewer, mason, glassblower, bookbinder, cheesemaker, saddler"
).split(", ")
GOODS = (
    "wool, apples, barley, salt, timber, honey, cheese, linen, copper pots, leather boots, "
    "glass jars, candles, rope, dried fish, cider, pottery"
).split(", ")
PLACES = "market, harbour, chapel, mill, school, library, inn, bakery, square, bridge".split(", ")
WEATHER = (
    "a cold wind came down from the hills, heavy rain flooded the lower fields, "
    "the first snow covered the roofs, a warm fog rolled in from the sea, "
    "the summer heat dried the wells, a storm broke the old fence"
).split(", ")
SEASONS = "spring, summer, autumn, winter".split(", ")
COLOURS = (
    "Amber, Azure, Crimson, Golden, Ivory, Jade, Silver, Scarlet, Violet, Copper, Indigo, "
    "Emerald, Russet, Cobalt, Coral, Ochre, Pearl, Slate, Saffron, Teal"
).split(", ")
ANIMALS = (
    "Heron, Falcon, Otter, Badger, Lynx, Raven, Stag, Wolf, Hare, Owl, Fox, Swan, Bison, "
    "Crane, Marten, Osprey, Beaver, Kestrel, Moose, Sparrow"
).split(", ")

_FILLER = (
    "{person} walked from {town} to {town2} along the old road and stopped at the {place} "
    "to buy {good}.",
    "In {season} {weather}, and the {trade}s of {town} closed their shops early.",
    "The {place} of {town} was repaired by {person}, a {trade} who had lived there for many years.",
    "Every market day the {trade}s of {town} sell {good} and {good2} to travellers from {town2}.",
    "{person} remembers the {season} when {weather} and nobody could reach {town}.",
    "The road between {town} and {town2} passes a quiet {place} where travellers rest in "
    "the afternoon.",
    "Children in {town} learn the trade of the {trade} from their parents and grandparents.",
    "Most families in {town2} keep a small garden and trade {good} with their neighbours.",
    "A letter from {person} describes the {place} of {town} as the busiest in the valley.",
    "When {weather}, the people of {town} gathered at the {place} and waited for news.",
    "The {trade} {person} sends {good} to {town2} twice a month on a slow cart.",
    "Old stories in {town} tell of a {trade} who crossed the river with a basket of {good}.",
)


def _fill(rng: random.Random, template: str) -> str:
    t1, t2 = rng.sample(TOWNS, 2)
    g1, g2 = rng.sample(GOODS, 2)
    return template.format(
        person=rng.choice(PEOPLE),
        town=t1,
        town2=t2,
        place=rng.choice(PLACES),
        good=g1,
        good2=g2,
        season=rng.choice(SEASONS),
        weather=rng.choice(WEATHER),
        trade=rng.choice(TRADES),
    )


def filler_sentences(rng: random.Random, n: int) -> list[str]:
    """``n`` sentences of filler prose (no numbers in them)."""
    return [_fill(rng, rng.choice(_FILLER)) for _ in range(n)]


class ChatPrompt:
    """Token pieces of SmolLM2-Instruct's chat format."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer

    def ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def user_start(self, system: str = SYSTEM) -> list[int]:
        return self.ids(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n")

    def user_end(self, answer_prefix: str = "") -> list[int]:
        return self.ids("<|im_end|>\n<|im_start|>assistant\n" + answer_prefix)

    def sentences(self, sentences: list[str]) -> list[list[int]]:
        """Each sentence's tokens, with its leading space (so they concatenate as text)."""
        return [self.ids(" " + s) for s in sentences]


# ------------------------------------------------------------------------------ needles


@dataclass
class Needle:
    label: str
    key: str
    depth: float
    """Where it was placed: token offset / haystack length."""
    position: int = 0
    """Its first token's index in the prompt."""

    @property
    def sentence(self) -> str:
        return f"The pass key for the {self.label} archive is {self.key}."

    @property
    def question(self) -> str:
        return f"What is the pass key for the {self.label} archive?"

    @property
    def answer_prefix(self) -> str:
        return f"The pass key for the {self.label} archive is"


@dataclass
class Haystack:
    """A shared prefix (instructions, filler, needles) and one question per needle."""

    prefix: list[int]
    needles: list[Needle]
    questions: list[list[int]] = field(default_factory=list)

    def prompts(self) -> list[list[int]]:
        return [self.prefix + q for q in self.questions]


NEEDLE_INSTRUCTIONS = (
    "Below is a long text about a valley of small towns. Hidden in it are pass keys of "
    "several archives. Read it carefully and remember every pass key; afterwards you will "
    "be asked for one of them.\n\n"
)


def make_haystack(
    tokenizer: Any,
    length: int,
    depths: list[float],
    rng: random.Random,
    question_room: int = 40,
    filler_seed: int | None = None,
) -> Haystack:
    """A prompt prefix (instructions, then filler) of about ``length -
    question_room`` tokens holding one needle per entry of ``depths`` (0..1:
    where in the filler), each with a distinct label and a random five-digit
    key; its questions ask for each key in turn. Haystacks made with the same
    ``filler_seed`` share their filler (and so their tokens up to the first
    needle, which an engine's prefix cache reuses)."""
    chat = ChatPrompt(tokenizer)
    head = chat.user_start() + chat.ids(NEEDLE_INSTRUCTIONS.rstrip(" "))
    labels = [
        f"{c} {a}"
        for c, a in zip(
            rng.sample(COLOURS, len(depths)), rng.sample(ANIMALS, len(depths)), strict=True
        )
    ]
    keys = [str(rng.randrange(10000, 100000)) for _ in depths]
    needles = [Needle(lbl, k, d) for lbl, k, d in zip(labels, keys, depths, strict=True)]
    needle_ids = [chat.ids(" " + n.sentence) for n in needles]
    filler_len = length - question_room - len(head) - sum(len(t) for t in needle_ids)
    sentences: list[list[int]] = []
    total = 0
    frng = random.Random(filler_seed) if filler_seed is not None else rng
    while total < filler_len:
        for s in chat.sentences(filler_sentences(frng, 16)):
            if total + len(s) > filler_len:
                break
            sentences.append(s)
            total += len(s)
        else:
            continue
        break
    # Each needle goes in between two sentences, at its depth.
    slots: dict[int, list[int]] = {}
    for i, n in enumerate(needles):
        slots.setdefault(round(n.depth * len(sentences)), []).append(i)
    body: list[int] = []
    for j in range(len(sentences) + 1):
        for i in slots.get(j, []):
            needles[i].position = len(head) + len(body)
            body += needle_ids[i]
        if j < len(sentences):
            body += sentences[j]
    hay = Haystack(head + body, needles)
    for n in needles:
        hay.questions.append(chat.ids("\n\n" + n.question) + chat.user_end(n.answer_prefix))
    return hay


def answer_digits(text: str) -> str:
    """The first run of digits in a generated answer (spaces inside ignored)."""
    m = re.search(r"\d[\d ]*", text)
    return m.group(0).replace(" ", "") if m else ""


# ------------------------------------------------------------------------------ RAG


_BUILDERS = PEOPLE
_LANDMARKS = (
    "Bridge, Tower, Lighthouse, Mill, Library, Observatory, Chapel, Theatre, Museum, "
    "Market Hall, Clock Tower, Boathouse, Granary, Bathhouse, Gatehouse, Windmill"
).split(", ")
_MATERIALS = "granite, red brick, oak timber, limestone, iron, sandstone, marble, slate".split(", ")
_SURNAMES = (
    "Halvard, Brennick, Castell, Dorwin, Everly, Fenwick, Garrow, Hollis, Ingram, Jessop, "
    "Kirkby, Lomond, Merrow, Norland, Orrin, Pellam, Quillon, Rusk, Selwyn, Tamsin, Ulric, "
    "Varden, Wymark, Yelland"
).split(", ")


_LANDMARK_PROSE = (
    "Its walls have weathered well over the years.",
    "Visitors often stop to admire the view from its steps.",
    "The building is especially beautiful in the evening light.",
    "A small garden with old trees surrounds it.",
    "Its roof was replaced after a long and careful repair.",
    "Guided walks pass by it several times a week.",
    "Local painters like to sketch it from across the road.",
    "Its doors are open to visitors on most afternoons.",
    "A narrow path leads from the main street to its entrance.",
    "Birds nest under its eaves every spring.",
    "Its windows are tall and let in plenty of light.",
    "Schoolchildren visit it to learn about the region's past.",
)


def landmark_sentences(rng: random.Random, n: int) -> list[str]:
    """``n`` sentences about a landmark that name no person, town or year, so
    that they never compete with a record's facts."""
    return [rng.choice(_LANDMARK_PROSE) for _ in range(n)]


@dataclass
class Record:
    """One RAG document: an invented landmark and its facts."""

    name: str
    town: str
    builder: str
    year: int
    material: str
    keeper: str
    text: str = ""


_RECORD_STYLE = (
    "{name} stands in the town of {town}. It was built in {year} by {builder}, who used "
    "{material} for its walls. Today it is looked after by {keeper}. {extra}",
    "Travellers to {town} often visit {name}. {builder} built it in {year}, mostly from "
    "{material}. The current keeper is {keeper}. {extra}",
)


def make_records(rng: random.Random, n: int, keeper_only: bool = False) -> list[Record]:
    """``n`` records with distinct names, towns, builders and keepers.

    ``keeper_only``: each document states one fact, who looks after the
    landmark, and no two documents share a keeper (``n`` <= 27): the easiest
    form of the task, for a model as small as SmolLM2-135M."""
    names = rng.sample([f"the {s} {k}" for s in _SURNAMES for k in _LANDMARKS], n)
    towns = [TOWNS[i % len(TOWNS)] for i in rng.sample(range(len(TOWNS)), min(n, len(TOWNS)))]
    if keeper_only and n > len(PEOPLE):
        raise ValueError(f"at most {len(PEOPLE)} records with distinct keepers")
    people = rng.sample(PEOPLE, min(len(PEOPLE), 2 * n))
    if keeper_only:
        people = [p for pair in zip(people, people, strict=True) for p in pair]
    out = []
    for i in range(n):
        r = Record(
            name=names[i],
            town=towns[i % len(towns)],
            builder=people[(2 * i) % len(people)],
            year=rng.randrange(1700, 1990),
            material=rng.choice(_MATERIALS),
            keeper=people[(2 * i + 1) % len(people)],
        )
        extra = " ".join(landmark_sentences(rng, 2))
        if keeper_only:
            r.text = f"Document about {r.name}:\n{r.name[0].upper()}{r.name[1:]} is looked "
            r.text += f"after by {r.keeper}. {extra}"
            out.append(r)
            continue
        style = rng.choice(_RECORD_STYLE)
        body = style.format(
            name=r.name[0].upper() + r.name[1:] if style.startswith("{name}") else r.name,
            town=r.town,
            year=r.year,
            builder=r.builder,
            material=r.material,
            keeper=r.keeper,
            extra=extra,
        )
        r.text = f"Document about {r.name}:\n{body}"
        out.append(r)
    return out


_QUESTIONS = (
    ("builder", "Who built {name}?", "{name} was built by"),
    ("year", "In which year was {name} built?", "{name} was built in the year"),
    ("town", "In which town does {name} stand?", "{name} stands in the town of"),
    ("keeper", "Who looks after {name} today?", "Today {name} is looked after by"),
)


def record_question(
    rng: random.Random, r: Record, fields: tuple[str, ...] | None = None
) -> tuple[str, str, str]:
    """(question, answer prefix, expected answer) about one record, asking
    one of ``fields`` (default: any)."""
    field_, q, prefix = rng.choice([x for x in _QUESTIONS if fields is None or x[0] in fields])
    p = prefix.format(name=r.name)
    return q.format(name=r.name), p[0].upper() + p[1:], str(getattr(r, field_))


RAG_INSTRUCTIONS = (
    "Answer the question using the documents below. Each document describes one landmark.\n\n"
)


@dataclass
class RagPrompt:
    """A question over documents: the prompt, where each document's tokens
    sit in it, and the expected answer."""

    tokens: list[int]
    chunks: list[tuple[int, int]]
    """(start, end) token span of each document in ``tokens``."""
    question: str
    answer_prefix: str
    expected: str


def rag_prompt(
    tokenizer: Any,
    docs: list[Record],
    target: Record,
    rng: random.Random,
    chunk_tokens: list[list[int]] | None = None,
    fields: tuple[str, ...] | None = None,
) -> RagPrompt:
    """Instructions, every document (each tokenized alone, so a document has
    the same tokens wherever it sits; ``chunk_tokens`` gives them ready-made)
    and a question about ``target`` (one of ``fields``) with the start of its
    answer."""
    chat = ChatPrompt(tokenizer)
    tokens = chat.user_start() + chat.ids(RAG_INSTRUCTIONS.rstrip(" "))
    spans = []
    for i, d in enumerate(docs):
        ids = chunk_tokens[i] if chunk_tokens is not None else document_tokens(tokenizer, d)
        spans.append((len(tokens), len(tokens) + len(ids)))
        tokens += ids
    question, prefix, expected = record_question(rng, target, fields)
    tokens += chat.ids("Question: " + question) + chat.user_end(prefix)
    return RagPrompt(tokens, spans, question, prefix, expected)


DOCUMENT_INSTRUCTIONS = "Answer the question using the document below.\n\n"


def document_prompt(
    tokenizer: Any, target: Record, tokens: int, rng: random.Random, field: str = "town"
) -> RagPrompt:
    """One document about ``target``, at most ``tokens`` long, and a question
    about its ``field``: the document opens with notes that name no person,
    town or year (:func:`landmark_sentences`, drawn by ``rng``) and ends with
    the record's facts, right before the question. SmolLM2-135M answers
    this; asked about one of many documents, it mostly names another
    document's fact."""
    chat = ChatPrompt(tokenizer)
    head = chat.user_start() + chat.ids(DOCUMENT_INSTRUCTIONS + f"About {target.name}:")
    facts = chat.ids("\n\n" + target.text + "\n\n")
    question, prefix, expected = record_question(rng, target, (field,))
    tail = chat.ids("Question: " + question) + chat.user_end(prefix)
    notes: list[int] = []
    while True:
        (sentence,) = chat.sentences(landmark_sentences(rng, 1))
        if len(head) + len(notes) + len(sentence) + len(facts) + len(tail) > tokens:
            break
        notes += sentence
    tokens_ = head + notes + facts + tail
    start = len(head) + len(notes)
    return RagPrompt(tokens_, [(start, start + len(facts))], question, prefix, expected)


def document_tokens(tokenizer: Any, doc: Record) -> list[int]:
    """One document's tokens as it appears in a RAG prompt."""
    return ChatPrompt(tokenizer).ids(doc.text + "\n\n")


def record_facts(records: list[Record]) -> list[str]:
    """Every fact a question about these records can have as its answer."""
    return sorted({str(getattr(r, f)) for r in records for f, _, _ in _QUESTIONS})


def first_fact_is(text: str, expected: str, facts: list[str]) -> bool:
    """Whether, of all ``facts``, the answer names ``expected`` first (case
    ignored): "the current keeper, Tara Wells." answers "Tara Wells", and an
    answer that names another record's fact first is wrong."""
    low = text.lower()
    found = [(low.find(f.lower()), -len(f), f) for f in facts if f.lower() in low]
    return bool(found) and min(found)[2] == expected


def answer_matches(text: str, expected: str) -> bool:
    """Whether a generated answer starts with the expected fact (case and
    punctuation ignored, a leading article allowed)."""
    norm = re.sub(r"[^a-z0-9 ]", " ", text.lower()).split()
    want = re.sub(r"[^a-z0-9 ]", " ", expected.lower()).split()
    if norm[:1] == ["the"] and want[:1] != ["the"]:
        norm = norm[1:]
    return norm[: len(want)] == want


__all__ = [
    "DOCUMENT_INSTRUCTIONS",
    "SYSTEM",
    "ChatPrompt",
    "Haystack",
    "Needle",
    "RagPrompt",
    "Record",
    "answer_digits",
    "answer_matches",
    "document_prompt",
    "document_tokens",
    "filler_sentences",
    "first_fact_is",
    "landmark_sentences",
    "make_haystack",
    "make_records",
    "rag_prompt",
    "record_facts",
    "record_question",
]
