"""Floor 6, the course: what a workshop runs on top of the labs, in one place.

`exercises` (the checkers of the lessons' exercises: they run the learner's code on a lab and say
precisely what is wrong), `room` (the room's folder: each attendee's lab and verdicts as records,
and the table an instructor reads) and `drill` (a room's capacity, measured: N attendees' lessons at
once). The notebook's `pplab.Lab` (floor 7) writes its records into the room; the drivers below know
nothing of rooms or lessons.
"""

from pplab.base.lazy import submodules_on_first_use

__getattr__ = submodules_on_first_use(__name__)  # pplab.course.<module> after a bare `import pplab`
