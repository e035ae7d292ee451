"""The trio runtime of one served model: its engine task and pacer task, the timer they
sleep on, the pacing-lag meter and the pacer's calibration."""
