"""The doctor: load once, then checks that prove with numbers a drafter is fed what it was trained on."""
