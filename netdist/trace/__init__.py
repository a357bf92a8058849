"""Tracing, the flight recorder and the offline analysis"""
