"""A small labelled sample for judging toxicity scorers (written for this lab, one sentence each).

Three kinds of line, as a web-scale filter meets them:

* ``offensive``: insults, harassment, threats and profanity aimed at a reader;
* ``nsfw``: the sexual spam that crawls are full of (C4's blocklist was aimed at it);
* ``clean``: ordinary sentences, many of them *hard negatives* - words a blocklist
  fires on in innocent use ("campus police had to escort him out", "Essex", "breast
  cancer screening", "sex education") and violent words in news and software.

The sentences are deliberately short and unambiguous so that a disagreement is the
scorer's, not the label's. Scores on it are a sanity check of a filter, not a
benchmark: a real evaluation uses thousands of annotated pages (Jigsaw, RealToxicityPrompts).

Whole real pages are judged against ``real_page_labels.json`` (:func:`real_page_labels`):
every page the reader keeps from ``../shared/data``, labelled by reading it. It lives beside
this module, not in ``tests/``, because the lab reads it; the pages themselves are only on
the course machines, so the lab and the tests use it only where that folder exists.
"""

from __future__ import annotations

import json
from pathlib import Path

REAL_PAGE_LABELS = Path(__file__).with_name("real_page_labels.json")

OFFENSIVE = (
    "You are a fucking idiot and everyone knows it.",
    "Shut up, you stupid bitch.",
    "Go kill yourself, nobody would miss you.",
    "What a worthless piece of shit you are.",
    "I hope you die in a fire, you moron.",
    "You're too dumb to breathe, you pathetic loser.",
    "Fuck off and never come back here.",
    "This asshole keeps posting garbage, ban him.",
    "You ugly fat pig, get off the internet.",
    "Nobody cares about your shitty opinion, dickhead.",
    "I will find where you live and beat the crap out of you.",
    "Eat shit, you brainless troll.",
    "She's a dumb slut who should be fired.",
    "Stop whining, you spineless little bastard.",
    "Your mother should have aborted you, retard.",
    "You are a disgusting creep and a liar.",
    "What the fuck is wrong with you people?",
    "Drop dead, you miserable old hag.",
    "Anyone who votes like that is a braindead moron.",
    "He is a lying scumbag and a total dick.",
    "Get lost, you cheap whore.",
    "I'm going to smash your stupid face in.",
    "Screw you and your idiotic little blog.",
    "You dumbass, read the damn article before commenting.",
    "Shut your filthy mouth, you cunt.",
    "People like you are a waste of oxygen.",
    "Piss off, nobody asked for your crap.",
    "You're a pathetic, whiny little prick.",
    "This author is a complete jackass.",
    "Go to hell, you hateful bigot.",
)

NSFW = (
    "Watch free xxx porn videos of hot horny teens.",
    "Hot milfs in your area want sex tonight, click here.",
    "Live sex cams with naked camgirls, no credit card needed.",
    "Download hardcore porn movies in HD for free.",
    "Horny singles are waiting to fuck you now.",
    "See her naked pussy on our nude webcam.",
    "Best free porn site with big tits and hot sluts.",
    "Get your dick sucked by local girls tonight.",
    "Amateur sex tapes leaked, watch the full video here.",
    "Nude celebrity photos uncensored, click to see more.",
    "XXX adult dating: meet sexy women who want to hook up.",
    "Wet pussy and big cock action in our members area.",
    "Erotic massage with happy ending, call now for an escort.",
    "Free hentai porn comics updated daily.",
    "Hot lesbian sex videos, 100% free and uncensored.",
    "Naughty girls strip naked live on cam for tips.",
    "The hottest anal porn scenes of the year.",
    "Busty babes get fucked hard in this xxx clip.",
    "Sexy nude pics of horny housewives next door.",
    "Click here for explicit adult content and porn.",
)

CLEAN = (
    "Campus police had to escort him out of the building.",
    "The Essex county council met on Tuesday to discuss the budget.",
    "Breast cancer screening saves thousands of lives every year.",
    "The school added a sex education class for older students.",
    "Gay rights activists marched through the city centre on Saturday.",
    "The museum tour included a nude statue from ancient Greece.",
    "Use kill -9 to stop the process if it does not respond.",
    "The hunter shot a deer near the river at dawn.",
    "The army attacked the fortress at night and took the bridge.",
    "Our dog, a pedigree bitch, gave birth to six puppies.",
    "The cocktail bar in Scunthorpe opens at six.",
    "Dick Grayson was the first Robin in the comics.",
    "The study measured testosterone levels in male athletes.",
    "A breastfeeding mother needs extra calories and water.",
    "The novel describes the horrors of war in plain language.",
    "He was charged with assault after the bar fight, police said.",
    "The vaccine trial enrolled twelve thousand adults.",
    "Cut the onions finely and fry them in butter.",
    "The lecture covered the anatomy of the pelvis and the hip joint.",
    "Hell's Kitchen is a neighbourhood on the west side of Manhattan.",
    "The band's new album drops next Friday.",
    "Climate change will raise sea levels by the end of the century.",
    "The river flooded the village and damaged the old bridge.",
    "Please submit your assignment by Monday morning.",
    "The committee rejected the proposal after a long debate.",
    "The HIV clinic offers free and confidential testing.",
    "The cat knocked a glass of water off the table.",
    "The firm reported record profits for the third quarter.",
    "She teaches a seminar on the history of sexuality in Victorian England.",
    "The shooting star was visible for two seconds.",
    "Execute the script and kill all child processes before exiting.",
    "The drug reduced the risk of stroke by a third.",
    "A bloody nose is usually harmless and stops within minutes.",
    "Firefighters battled the blaze for six hours.",
    "The weather will be sunny with a light breeze.",
    "Our escort service takes elderly patients to their appointments.",
    "The painting shows Adam and Eve naked in the garden.",
    "The documentary examines the trafficking of endangered animals.",
    "The referee sent off two players for violent conduct.",
    "A hate crime is a crime motivated by prejudice against a group.",
    "The library extended its opening hours during the exam period.",
    "The condom distribution programme reduced infection rates.",
    "The suspect was arrested for the murder of two people.",
    "Grandma knitted a scarf for each of her grandchildren.",
    "The rooster woke the whole farm at five in the morning.",
    "He missed the penalty and the crowd booed loudly.",
    "The anime series was praised for its animation.",
    "The train to Middlesex leaves from platform four.",
    "Researchers released an open dataset of annotated web pages.",
    "Always back up your data before upgrading the system.",
)

SAMPLE: tuple[tuple[str, str], ...] = tuple(
    [("offensive", text) for text in OFFENSIVE] + [("nsfw", text) for text in NSFW]
    + [("clean", text) for text in CLEAN])


def real_page_labels(path: Path = REAL_PAGE_LABELS) -> dict[str, tuple[str, str]]:
    """Record id -> (label, one-line reason) of the real pages labelled by reading them."""
    pages = json.loads(Path(path).read_text(encoding="utf-8"))["pages"]
    return {page["id"]: (page["label"], page["reason"]) for page in pages}
